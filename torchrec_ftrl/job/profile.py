"""``--profile-steps K``: ``torch.profiler`` over K training steps, and the mean time per step of each
phase of a step, on the host and on the device.

Phases (:data:`PHASES`):

* ``data``: reading the next batch and its host-to-device copy, and waiting for it;
* ``input_dist``: the sparse input all-to-all (KJT splits and tensors) of the sharded embedding module;
* ``sparse``: the sharded embedding module's lookup and pooled-embedding output all-to-all in the
  forward, and its backward (output all-to-all backward, the fused backward + sparse optimizer update);
* ``dense``: the rest of the forward (bottom / top MLP, interaction, loss) and of the backward
  (including the data-parallel gradient all-reduce of the MLPs);
* ``optimizer``: ``zero_grad`` and the dense optimizer step;
* ``metrics``: the loss window (``loss_log.LossLog``: its sum, cross-rank mean and asynchronous copy to
  the host), the loss history, the progress bar and the touched-row tracker.

Host time (CPU wall) is read from the profiling thread's ranges: TorchRec's pipeline labels, the same
labels in the plain loop (``pipeline.PlainLoop``), TorchRec's all-to-all labels, the job's own
``## ctr:* ##`` labels and the autograd engine's ``autograd::engine::evaluate_function: <Node>``
ranges. Each instant of a step goes to the innermost range that :data:`HOST_RULES` classify (instants
in no classified range are in no phase: ``host_step_ms`` minus the phase sum). The backward is split
by its autograd nodes: a node named by :data:`SPARSE_NODE` is ``sparse``, any other ``dense``; where
the nodes run on another thread (the autograd engine's device thread on a GPU), the profiling thread's
wait in ``## backward ##`` is split in the proportion of the two kinds' node time. Validation and
checkpoints inside the profiled steps (``## ctr:excluded ... ##``) count in no phase.

Device time (CUDA) is the duration of each kernel, memcpy and memset, given to the phase of the host
range that launched it (the CPU op the profiler correlates it with, classified as above on its own
thread). A kernel without such a range is classified by its name (:data:`KERNEL_RULES`): TBE /
FBGEMM / Triton embedding kernels (``tbe``, ``embedding``, ``segment``, ``linearize``, ``fbgemm``,
``ftrl``) -> ``sparse``; ``nccl`` -> ``input_dist``; ``Memcpy HtoD`` -> ``data``; ``Memcpy DtoH``
-> ``metrics``; ``multi_tensor_apply`` / ``foreach`` / ``adagrad`` / ``adam`` -> ``optimizer``;
anything else (GEMMs, elementwise) -> ``dense``. Device phases overlap each other and the host (that
is what the pipeline is for), so their sum is not a step time.
"""

from __future__ import annotations

import bisect
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

PHASES = ("data", "input_dist", "sparse", "dense", "optimizer", "metrics")
SPARSE_LABEL = "## ctr:sparse_arch ##"
METRICS_LABEL = "## ctr:metrics ##"          # the loop's loss bookkeeping and progress bar
TRACKER_LABEL = "## ctr:touch_tracker ##"    # the touched-row masks of a finished step
EXCLUDED_PREFIX = "## ctr:excluded"  # + " <what> ##": a range that counts in no phase
BACKWARD = "backward"   # a host phase that is split into sparse / dense (see the module docstring)
EXCLUDED = "excluded"
NODE_PREFIX = "autograd::engine::evaluate_function: "
WARMUP_STEPS = 3         # steps before the profiled ones (the first fills the pipeline and traces)

# Host range name -> phase; the first matching rule names a range's phase.
HOST_RULES = tuple((re.compile(p), phase) for p, phase in (
    ("^" + re.escape(EXCLUDED_PREFIX), EXCLUDED),
    (r"^## (next_batch|copy_batch_to_gpu|inplace_copy_batch_to_gpu|wait_for_batch)\b", "data"),
    (r"^## (start_sparse_data_dist|wait_sparse_data_dist|runtime_forward_assemble_KJT)\b", "input_dist"),
    (r"^## all2all_data:", "input_dist"),                 # TorchRec's KJT all-to-all (dist_data.py)
    (r"^## KJTAllToAll\w* wait\(\) ##", "input_dist"),    # its awaitables
    ("^" + re.escape(SPARSE_LABEL), "sparse"),           # DLRM.sparse_arch: the sharded EBC
    (r"^## forward\b", "dense"),
    (r"^## backward\b", BACKWARD),
    (r"^## (zero_grad|optimizer)\b", "optimizer"),
    ("^(" + re.escape(METRICS_LABEL) + "|" + re.escape(TRACKER_LABEL) + ")", "metrics"),
))
# An autograd node of the sharded embedding module: the TBE lookups (fbgemm's SplitLookupFunction_*,
# torchrec_ftrl's _FTRLLookupFunction) and TorchRec's output dist (comm_ops.All2All_Pooled_*,
# ReduceScatter*_Req/_Wait, AllGatherBase_*, fbgemm's permute_pooled_embs).
SPARSE_NODE = re.compile(
    r"(?i)(tbe|embedding|lookup|fbgemm|ftrl|all2all|alltoall|reducescatter|allgather|permute_?pooled)")
KERNEL_RULES = tuple((re.compile(p), phase) for p, phase in (
    (r"(?i)(tbe|embedding|segment|linearize|fbgemm|ftrl)", "sparse"),
    (r"(?i)nccl", "input_dist"),
    (r"(?i)memcpy htod", "data"),
    (r"(?i)memcpy dtoh", "metrics"),
    (r"(?i)(multi_tensor_apply|foreach|adagrad|adam)", "optimizer"),
))


def host_phase(name: str) -> Optional[str]:
    """The phase (or ``"backward"`` / ``"excluded"``) of a host range ``name``; None: unclassified.
    An autograd node range is ``sparse`` or ``dense`` (:data:`SPARSE_NODE` on its node name)."""
    if name.startswith(NODE_PREFIX):
        return "sparse" if SPARSE_NODE.search(name[len(NODE_PREFIX):]) else "dense"
    for pattern, phase in HOST_RULES:
        if pattern.search(name):
            return phase
    return None


def kernel_phase(name: str) -> str:
    """The phase of a device kernel from its name alone (:data:`KERNEL_RULES`, else ``dense``)."""
    for pattern, phase in KERNEL_RULES:
        if pattern.search(name):
            return phase
    return "dense"


class _Ranges:
    """The classified ranges of one thread, for 'innermost classified range containing [a, b]'."""

    def __init__(self, ranges: Iterable[Tuple[float, float, str]]) -> None:
        ranges = list(ranges)
        self.items = sorted((r for r in ranges if r[2] != EXCLUDED), key=lambda r: (r[0], -r[1]))
        self.starts = [r[0] for r in self.items]
        self.longest = max((e - s for s, e, _ in self.items), default=0.0)
        self.excluded = [(s, e) for s, e, phase in ranges if phase == EXCLUDED]

    def phase_at(self, a: float, b: float) -> Optional[str]:
        """The phase of ``[a, b]``: ``excluded`` when an excluded range contains it, else the phase of
        the containing range that starts last (the innermost: ranges of one thread nest)."""
        if any(s <= a and b <= e for s, e in self.excluded):
            return EXCLUDED
        for i in range(bisect.bisect_right(self.starts, a) - 1, -1, -1):
            s, e, phase = self.items[i]
            if s < a - self.longest:
                break  # no earlier range is long enough to contain [a, b]
            if e >= b:
                return phase
        return None


def _cpu(events) -> list:
    """The host events (the device ones are reached through each host event's ``kernels``)."""
    return [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU]


def attribute(events: Sequence, main_thread: Optional[int] = None) -> dict:
    """Phase times of profiler ``events`` (``prof.events()``: ``FunctionEvent`` with ``name``,
    ``thread``, ``time_range.start/end`` in us, ``device_type``, ``kernels``), as described in the
    module docstring.

    Returns ``{"steps": n, "host_ms": {phase: ms per step}, "device_ms": {phase: ms per step},
    "host_step_ms": mean wall ms of a step without excluded time}``, n the number of
    ``ProfilerStep#*`` ranges; ``device_ms`` is empty when no event carries device time.

    Raises:
        ValueError: no ``ProfilerStep#*`` range among ``events``.
    """
    cpu = _cpu(events)
    steps = [e for e in cpu if e.name.startswith("ProfilerStep")]  # "ProfilerStep*" (#N in the trace)
    if not steps:
        raise ValueError("no ProfilerStep#* range in the profile (prof.step() never ran)")
    main = steps[0].thread if main_thread is None else main_thread
    by_thread: Dict[int, list] = {}
    for e in cpu:
        phase = host_phase(e.name)
        if phase is not None:
            by_thread.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end, phase))
    ranges = {t: _Ranges(r) for t, r in by_thread.items()}
    main_ranges = ranges.get(main, _Ranges([]))

    host = dict.fromkeys(PHASES, 0.0)
    bare_backward = excluded = 0.0
    windows = [(s.time_range.start, s.time_range.end) for s in steps if s.thread == main]
    for w0, w1 in windows:
        cuts = {w0, w1}
        for s, e in [(s, e) for s, e, _ in main_ranges.items] + main_ranges.excluded:
            if e > w0 and s < w1:
                cuts.update((max(s, w0), min(e, w1)))
        cuts = sorted(cuts)
        for a, b in zip(cuts, cuts[1:]):
            phase = main_ranges.phase_at(a, b)
            if phase == EXCLUDED:
                excluded += b - a
            elif phase == BACKWARD:
                bare_backward += b - a
            elif phase is not None:
                host[phase] += b - a
    # the profiling thread's own wait in the backward: split by the node time on other threads
    other = {"sparse": 0.0, "dense": 0.0}
    for t, r in ranges.items():
        if t == main:
            continue
        for s, e, phase in r.items:
            if phase in other and any(s < w1 and e > w0 for w0, w1 in windows):
                other[phase] += e - s
    total_other = other["sparse"] + other["dense"]
    share = other["sparse"] / total_other if total_other > 0 else 0.0
    host["sparse"] += bare_backward * share
    host["dense"] += bare_backward * (1.0 - share)

    device = {}
    for e in cpu:
        kernels = getattr(e, "kernels", None) or []
        if not kernels:
            continue
        r = ranges.get(e.thread)
        phase = r.phase_at(e.time_range.start, e.time_range.end) if r is not None else None
        if phase == EXCLUDED:
            continue
        for k in kernels:
            if k.name.startswith(("## ", "ProfilerStep")):
                continue  # a host range's projection on the device timeline, not a kernel
            ph = phase if phase in PHASES else ("dense" if phase == BACKWARD else kernel_phase(k.name))
            device[ph] = device.get(ph, 0.0) + float(k.duration)
    n = len(windows)
    wall = sum(w1 - w0 for w0, w1 in windows)
    return {"steps": n,
            "host_ms": {p: host[p] / n / 1e3 for p in PHASES},
            "device_ms": {p: device.get(p, 0.0) / n / 1e3 for p in PHASES} if device else {},
            "host_step_ms": (wall - excluded) / n / 1e3}


class StepProfiler:
    """``torch.profiler.profile`` over ``active`` steps after ``warmup`` steps (CPU activity, plus
    CUDA on a GPU); call :meth:`step` after every training step. When the profiled steps are done,
    the chrome trace is written to ``trace_path`` and :attr:`result` holds :func:`attribute` of them
    (plus ``"warmup_steps"`` and ``"trace"``). ``module``: the DLRM whose ``sparse_arch`` is labelled
    :data:`SPARSE_LABEL` while profiling (forward hooks, removed at :meth:`close`).

    Raises:
        ValueError: ``active < 1`` or ``warmup < 0``.
    """

    def __init__(self, active: int, warmup: int, device: torch.device, trace_path: str,
                 module: Optional[torch.nn.Module] = None) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        if active < 1 or warmup < 0:
            raise ValueError(f"need active >= 1 and warmup >= 0, got {active}, {warmup}")
        self.trace_path, self.warmup, self.result = trace_path, warmup, None
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # the profiler's own warm-up step (recorded, then dropped) is the last of ours
        sched = schedule(wait=max(warmup - 1, 0), warmup=min(warmup, 1), active=active, repeat=1)
        self._prof = profile(activities=activities, schedule=sched, on_trace_ready=self._ready)
        self._hooks = _label_module(module.sparse_arch, SPARSE_LABEL) if module is not None else []
        self._prof.__enter__()
        self._open = True

    def _ready(self, prof) -> None:
        import os
        os.makedirs(os.path.dirname(self.trace_path) or ".", exist_ok=True)
        prof.export_chrome_trace(self.trace_path)
        self.result = {**attribute(prof.events()), "warmup_steps": self.warmup,
                       "trace": self.trace_path}

    def step(self) -> None:
        if self._open:
            self._prof.step()

    def close(self) -> None:
        """Stop profiling (idempotent); removes the hooks."""
        if self._open:
            self._open = False
            self._prof.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _label_module(module: torch.nn.Module, label: str) -> list:
    """Forward pre/post hooks that open and close ``record_function(label)`` around ``module``."""
    from torch.autograd.profiler import record_function

    stack: List = []

    def pre(_mod, _args):
        rf = record_function(label)
        rf.__enter__()
        stack.append(rf)

    def post(_mod, _args, _out):
        if stack:
            stack.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def plan(steps_to_run: int, profile_steps: int) -> Tuple[int, int]:
    """``(warmup, active)`` steps for ``--profile-steps profile_steps`` when ``steps_to_run`` steps
    run: ``active = min(profile_steps, steps_to_run)`` and up to :data:`WARMUP_STEPS` warm-up steps
    before them (fewer when the run is short). ``(0, 0)``: no profiling."""
    if profile_steps <= 0 or steps_to_run <= 0:
        return 0, 0
    active = min(profile_steps, steps_to_run)
    return min(WARMUP_STEPS, steps_to_run - active), active
