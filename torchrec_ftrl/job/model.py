"""DLRM with one embedding table per categorical feature, sharded by DMP with fused sparse optimizer;
its forward takes a batch and returns ``(loss, output)`` (what TorchRec's train pipelines call)."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.optim.keyed import KeyedOptimizerWrapper

from .dense_precision import dense_logits

GIB = 2 ** 30
# The DLRM submodules that make up its dense part.
DENSE_PARTS = ("dense_arch", "inter_arch", "over_arch")


# Whether torch.fx is tracing (torch >= 2.9 names the symbolic-trace-only test apart from export's).
_fx_symbolic_tracing = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing",
                               torch.fx._symbolic_trace.is_fx_tracing)


class _CTRForward:
    """The train-pipeline forward of :class:`CTRTrain` and :class:`CTRTrainDCN` (documented there)."""

    def __init__(self, num_dense: int, dense_precision: str = "fp32", **dlrm_kwargs) -> None:
        super().__init__(**dlrm_kwargs)
        self.num_dense = int(num_dense)
        self.dense_precision = dense_precision
        self.dense_device_type = torch.device(dlrm_kwargs.get("dense_device") or "cpu").type
        self.compiled_dense_logits = None                 # a plain attribute: no state_dict key

    def forward(self, batch):  # documented on CTRTrain
        dense = (batch.dense_features if self.num_dense > 0
                 else torch.ones_like(batch.labels).unsqueeze(1))
        logits = self.dense_logits(dense, self.sparse_arch(batch.sparse_features))
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)

    def dense_logits(self, dense: torch.Tensor, embedded_sparse: torch.Tensor) -> torch.Tensor:
        """``dense_precision.dense_logits`` of this model: in training (``self.training`` and grad
        mode) the compiled function of :func:`compile_dense` or the CUDA graphs of
        :func:`graph_dense` where either was made, else eager (evaluation,
        and TorchRec's train pipelines tracing the forward with ``torch.fx``, which cannot trace a
        compiled function). ``dense`` ``[B, num_dense or 1]`` float32, ``embedded_sparse``
        ``[B, F, D]`` float32; returns ``[B]`` float32 logits."""
        fn = dense_logits
        if (self.compiled_dense_logits is not None and self.training and torch.is_grad_enabled()
                and not _fx_symbolic_tracing()):
            fn = self.compiled_dense_logits
        return fn(self, dense, embedded_sparse, self.dense_precision, self.dense_device_type)


class CTRTrain(_CTRForward, DLRM):
    """TorchRec's ``DLRM`` with the forward a train pipeline calls: ``forward(batch) -> (loss,
    (loss, logits, labels))``, as ``torchrec.models.dlrm.DLRMTrain`` returns it: the sparse arch,
    then the dense part (:meth:`dense_logits`), for a
    ``torchrec.datasets.utils.Batch`` (``dense_features [B, num_dense]`` float32, KJT
    ``sparse_features``, ``labels [B]`` float32). ``loss`` is the 0-d float32 batch-mean binary
    cross-entropy of the logits; ``logits`` ``[B]`` float32 (detached); ``labels`` the batch's.
    ``dense_precision`` (``dense_precision.DENSE_PRECISIONS``) is the arithmetic of the bottom MLP,
    the interaction and the top MLP (``dense_precision.dense_logits``): under ``bf16`` they run in
    bf16 autocast, the embedding lookup stays fp32 and the logits are cast to fp32 before the loss.

    Unlike ``DLRMTrain``, which holds the DLRM as ``.model``, it *is* the DLRM: parameter and
    state_dict names are DLRM's (``sparse_arch.embedding_bag_collection.embedding_bags.t_C1.weight``,
    ...). With ``num_dense == 0`` the dense input is a constant ``ones [B, 1]`` (the bottom MLP then
    learns a bias), which ``DLRMTrain`` cannot express.
    """


class CTRTrainDCN(_CTRForward, DLRM_DCN):
    """:class:`CTRTrain` over TorchRec's ``DLRM_DCN`` (the interaction is a low-rank DCN-v2 cross
    network, ``dcn_num_layers`` layers of rank ``dcn_low_rank_dim``; Wang et al., "DCN V2", 2021, as
    in MLPerf's DLRM-DCNv2): same forward, same parameter-name scheme."""


def build_dlrm(feature_names: Sequence[str], num_embeddings: Sequence[int], embedding_dim: int,
               num_dense: int, dense_arch: Sequence[int], over_arch: Sequence[int],
               dense_device: torch.device, dcn: Optional[tuple[int, int]] = None,
               zero_init: bool = False, dense_precision: str = "fp32") -> nn.Module:
    """Unsharded ``CTRTrain`` (a TorchRec ``DLRM``), or with ``dcn = (num_layers, low_rank_dim)``
    ``CTRTrainDCN`` (TorchRec's ``DLRM_DCN``): ``EmbeddingBagCollection`` on the meta device
    (DMP materialises it), one sum-pooled table ``t_{feature}`` per feature, bottom MLP
    ``dense_arch + [embedding_dim]`` over ``max(num_dense, 1)`` inputs, top MLP ``over_arch + [1]``.
    Forward: ``Batch -> (loss 0-d, (loss, logits [B], labels [B]))`` (see ``CTRTrain``).
    ``dense_device`` ``meta`` builds the whole model without memory (for planning only). Every
    parameter and buffer of the dense part is on ``dense_device``.
    ``zero_init``: the tables' ``init_fn`` is ``torch.nn.init.zeros_`` (else TorchRec's default
    uniform initialisation). ``dense_precision``: the dense part's arithmetic (``CTRTrain``).

    Raises:
        ValueError: ``feature_names`` and ``num_embeddings`` of different lengths.
    """
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    if len(feature_names) != len(num_embeddings):
        raise ValueError(f"{len(feature_names)} features but {len(num_embeddings)} table sizes")
    init = dict(init_fn=torch.nn.init.zeros_) if zero_init else {}
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=embedding_dim, num_embeddings=n,
                                 feature_names=[f], pooling=PoolingType.SUM, **init)
              for f, n in zip(feature_names, num_embeddings)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    common = dict(embedding_bag_collection=ebc, dense_in_features=max(num_dense, 1),
                  dense_arch_layer_sizes=[*dense_arch, embedding_dim],
                  over_arch_layer_sizes=[*over_arch, 1], dense_device=dense_device,
                  dense_precision=dense_precision)
    if dcn is None:
        model = CTRTrain(num_dense, **common)
    else:
        model = CTRTrainDCN(num_dense, dcn_num_layers=dcn[0], dcn_low_rank_dim=dcn[1], **common)
    for name in DENSE_PARTS:   # TorchRec builds the DCN cross net and triu_indices on the CPU
        getattr(model, name).to(dense_device)
    return model


class PlanDoesNotFitError(ValueError):
    """TorchRec's planner found no placement of the sparse tables in the memory it was given; the
    message says how many bytes the tables need and what the topology offers."""


def compute_kernels(device_type: str) -> list[str]:
    """Compute kernels the planner may choose: ``fused`` (tables in HBM, or in host memory on the
    CPU), and on CUDA also ``fused_uvm_caching`` (a table in host memory with an HBM cache of its
    rows, where TorchRec's planner puts a table that HBM cannot hold) and ``fused_uvm`` (a table in
    unified memory, for row layouts the cache does not hold)."""
    return ["fused", "fused_uvm_caching", "fused_uvm"] if device_type == "cuda" else ["fused"]


def make_planner(table_names: Sequence[str], sharding_types: Sequence[str], device_type: str,
                 world_size: int, local_world_size: int, batch_size: int, hbm_bytes: Optional[int],
                 ddr_bytes: Optional[int]):
    """TorchRec's ``EmbeddingShardingPlanner`` (its enumerator is torchrec_ftrl's for FTRL tables,
    :mod:`torchrec_ftrl.integration.planner`) for ``world_size`` devices of ``hbm_bytes`` HBM and
    ``ddr_bytes`` host memory each (``Topology``'s ``hbm_cap`` / ``ddr_cap``; None: TorchRec's
    defaults, 32 GiB / 128 GiB), each table limited to ``sharding_types`` and
    :func:`compute_kernels`."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    kernels = compute_kernels(device_type)
    constraints = {t: ParameterConstraints(sharding_types=list(sharding_types), compute_kernels=kernels)
                   for t in table_names}
    topology = Topology(world_size=world_size, compute_device=device_type,
                        local_world_size=local_world_size, hbm_cap=hbm_bytes, ddr_cap=ddr_bytes)
    return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size,
                                    constraints=constraints, debug=False)


def device_memory_bytes(device: torch.device, hbm_gib: Optional[float], host_gib: Optional[float],
                        local_world_size: int) -> tuple[Optional[int], Optional[int]]:
    """``(hbm_cap, ddr_cap)`` per rank in bytes: ``hbm_gib`` GiB, else on CUDA the device's total
    memory (None on the CPU: TorchRec's default); ``host_gib`` GiB of the host, else the host's
    physical memory, divided among the ``local_world_size`` ranks of the host."""
    hbm = int(hbm_gib * GIB) if hbm_gib is not None else (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)
    if host_gib is not None:
        host = int(host_gib * GIB)
    else:
        import os
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return hbm, host // max(1, local_world_size)


def shard(model: nn.Module, table_names: Sequence[str], sharders: list, device: torch.device,
          sharding_types: Sequence[str], world_size: int, local_world_size: int, batch_size: int,
          hbm_bytes: Optional[int] = None, ddr_bytes: Optional[int] = None,
          no_fit_message=None):
    """Plan (:func:`make_planner`: ``fused``, on CUDA also ``fused_uvm_caching``; ``sharding_types``
    as allowed; ``hbm_bytes`` / ``ddr_bytes`` per rank) and wrap in DMP. The plan is made before
    DMP allocates any table.

    Returns ``(dmp_model, plan)``.

    Raises:
        PlanDoesNotFitError: the planner placed no plan in that memory (message:
            ``no_fit_message()`` when given, else the planner's).
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import PlannerError

    planner = make_planner(table_names, sharding_types, device.type, world_size, local_world_size,
                           batch_size, hbm_bytes, ddr_bytes)
    try:
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    except PlannerError as e:
        kind = getattr(getattr(e, "error_type", None), "value", "")
        if kind not in ("insufficient_storage", "partition"):
            raise
        raise PlanDoesNotFitError(no_fit_message() if no_fit_message else str(e)) from None
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders,
                                   data_parallel_wrapper=data_parallel_wrapper(world_size))
    return dmp, plan


def data_parallel_wrapper(world_size: int):
    """DMP's ``data_parallel_wrapper`` for a run of ``world_size`` ranks: TorchRec's default (DDP
    around the dense part) for several ranks; for one rank, a wrapper that leaves the dense part
    unwrapped. DDP on one rank averages each gradient over that rank alone, an identity, at the
    price of its autograd hooks, bucket copies and an all-reduce per bucket every step. The state
    dict's keys do not change (DMP's name the unwrapped module's)."""
    if world_size > 1:
        return None
    from torchrec.distributed.model_parallel import DataParallelWrapper

    class _Unwrapped(DataParallelWrapper):
        def wrap(self, dmp, env, device) -> None:
            dmp._dmp_wrapped_module.to(device)   # what TorchRec's DDP wrapper does before wrapping

    return _Unwrapped()


def plan_summary(plan: Any) -> dict:
    """``{table: "sharding_type/compute_kernel ranks [...]"}`` from a ShardingPlan."""
    out = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():
            out[table] = f"{ps.sharding_type}/{ps.compute_kernel} ranks {ps.ranks}"
    return out


# The job's dense optimizers: name -> torch.optim class.
DENSE_OPTIMIZERS = {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


@functools.lru_cache(maxsize=None)
def fused_step_runs(cls: type, device_type: str) -> bool:
    """Whether torch optimizer ``cls`` steps with ``fused=True`` on ``device_type``: one step of a
    one-element fp32 parameter there with a zero gradient. torch decides per optimizer and device in
    its step (its fused Adagrad takes CPU tensors only, though ATen registers a CUDA kernel of
    ``_fused_adagrad_``), so the step is the test."""
    p = torch.zeros(1, device=device_type, requires_grad=True)
    p.grad = torch.zeros_like(p)
    try:
        cls([p], lr=0.01, fused=True).step()
    except (RuntimeError, TypeError, ValueError):   # torch's refusal of fused on this device
        return False
    return True


def dense_optimizer_options(name: str, device_type: str, fused_runs=fused_step_runs) -> dict:
    """The implementation keyword of the dense optimizer ``name`` (a key of
    :data:`DENSE_OPTIMIZERS`) on ``device_type``: on CUDA ``{"fused": True}`` (one multi-tensor
    kernel for all MLP parameters) when ``fused_runs(cls, "cuda")`` says torch steps it fused
    there, else ``{"foreach": True}``; on the CPU ``{"foreach": True}``, bitwise the updates of
    torch's per-parameter loop (``tests/test_job_dense.py``)."""
    cls = DENSE_OPTIMIZERS[name]
    if device_type == "cuda" and fused_runs(cls, "cuda"):
        return {"fused": True}
    return {"foreach": True}


class DenseOptimizer(KeyedOptimizerWrapper):
    """TorchRec's ``KeyedOptimizerWrapper`` whose ``zero_grad`` always frees the gradients
    (``set_to_none=True``, torch's default; ``CombinedOptimizer.zero_grad`` passes False). The next
    backward then hands each parameter its new gradient tensor instead of adding it into a zeroed
    one: one add kernel a parameter fewer, the same values. A dense part in CUDA graphs
    (:func:`graph_dense`) needs it: there a kept gradient is the graph's own buffer, which the next
    replay overwrites before autograd adds into it."""

    def zero_grad(self, set_to_none: bool = True) -> None:   # noqa: ARG002 (always frees)
        super().zero_grad(set_to_none=True)


def build_optimizer(dmp: nn.Module, name: str, lr: float, device_type: str = "cpu"):
    """``CombinedOptimizer([dmp.fused_optimizer, dense])``; the dense part (MLPs) uses ``name``
    (adagrad / adam / sgd) with :func:`dense_optimizer_options` for ``device_type`` through
    :class:`DenseOptimizer`; embedding tables are updated in backward by the fused optimizer."""
    from torchrec.optim.keyed import CombinedOptimizer
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    cls = DENSE_OPTIMIZERS[name]
    options = dense_optimizer_options(name, device_type)
    dense = DenseOptimizer(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                           lambda params: cls(params, lr=lr, **options))
    return CombinedOptimizer([dmp.fused_optimizer, dense])


def init_dense_state(opt, fused_optimizer) -> None:
    """Create the lazy state of the dense optimizers of ``opt`` (a ``CombinedOptimizer``; all but
    ``fused_optimizer``) by TorchRec's ``KeyedOptimizer.init_state``: one step with zero gradients,
    which moves no parameter of the job's optimizers (no weight decay). Torch's Adam creates its
    moments and step at its first step, so without this a resumed run's fresh optimizer has no keys
    for the checkpoint's Adam state to load into (DCP loads the keys the live state has) and restarts
    it silently. For a resume only: a fresh run's first step creates the state as torch does."""
    for _, keyed in opt.optimizers:
        if keyed is not fused_optimizer:
            keyed.init_state()


# torch.compile modes of the dense part: "default" (inductor: fused elementwise kernels, one host
# call a graph).
COMPILE_MODES = ("default",)


def compile_dense(model: nn.Module, mode: str = "default") -> None:
    """``torch.compile(dense_precision.dense_logits, mode=mode, dynamic=False)`` as ``model``'s
    (a ``CTRTrain`` / ``CTRTrainDCN``) training dense part: bottom MLP, interaction and top MLP in
    one graph forward and one backward. Parameters and their names do not change, so checkpoints
    are the same; the sharded embedding module stays eager (TorchRec's train pipelines rewrite its
    forward).

    Raises:
        ValueError: ``mode`` not in :data:`COMPILE_MODES`.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    model.compiled_dense_logits = torch.compile(dense_logits, mode=mode, dynamic=False)


def warm_up_dense(model: nn.Module, batch_size: int) -> None:
    """Run the training dense part of ``model`` (a ``CTRTrain`` / ``CTRTrainDCN``) before the first
    training step, so that its one-off costs fall outside the timed steps: the compile after
    :func:`compile_dense` (for the training shapes), and on CUDA the first calls' set-up of cuBLAS
    and of the allocator's pools. It is one forward and backward of :meth:`CTRTrain.dense_logits` (the
    model's precision) on the zero inputs of :func:`_dense_inputs`. The gradients it leaves on the
    dense parameters are dropped (set to None): parameters and
    optimizer state are untouched. Call it before sharding, while no parameter holds a gradient."""
    dense, pooled = _dense_inputs(model, batch_size, next(model.dense_arch.parameters()).device)
    model.dense_logits(dense, pooled).sum().backward()
    for name in DENSE_PARTS:
        for p in getattr(model, name).parameters():
            p.grad = None


class _DensePart(nn.Module):
    """The training dense part of a ``CTRTrain`` / ``CTRTrainDCN`` as a module of its own, the form
    ``torch.cuda.make_graphed_callables`` captures: its :data:`DENSE_PARTS` (the model's own
    modules, shared, not copied) and ``forward(dense, embedded_sparse) = fn(self, dense,
    embedded_sparse, precision, device_type)`` with ``fn`` :func:`dense_precision.dense_logits` or
    its compiled form."""

    def __init__(self, model: nn.Module, fn) -> None:
        super().__init__()
        for name in DENSE_PARTS:
            setattr(self, name, getattr(model, name))
        self.fn, self.precision, self.device_type = fn, model.dense_precision, model.dense_device_type

    def forward(self, dense: torch.Tensor, embedded_sparse: torch.Tensor) -> torch.Tensor:
        return self.fn(self, dense, embedded_sparse, self.precision, self.device_type)


class _GraphedDenseLogits:
    """``model.compiled_dense_logits`` after :func:`graph_dense`: a call whose inputs have the
    captured shapes, dtypes and devices (and pooled embeddings that require grad) replays the
    captured CUDA graphs (one forward graph; autograd replays the backward graph); any other call
    (a short last batch) runs ``fallback``. ``replays`` and ``fallbacks`` count the two. The
    returned logits are a copy (with autograd), so they outlive the next replay, which overwrites
    the graphs' outputs.

    The backward graph hands autograd its own gradient buffers, which a parameter without a
    gradient adopts as ``.grad``; a replay under a gradient kept from the last one would write into
    it and then have autograd add the same values again. So a replay needs the dense gradients
    freed (``zero_grad(set_to_none=True)``, :class:`DenseOptimizer`) since the last backward, and
    raises ``RuntimeError`` when ``probe`` (a dense parameter) still holds one."""

    def __init__(self, graphed: nn.Module, dense: torch.Tensor, pooled: torch.Tensor, fallback,
                 probe: torch.Tensor):
        self.graphed, self.fallback, self.probe = graphed, fallback, probe
        self.signature = [(t.shape, t.dtype, t.device) for t in (dense, pooled)]
        self.replays = self.fallbacks = 0

    def __call__(self, dlrm, dense, embedded_sparse, precision, device_type):
        if (embedded_sparse.requires_grad and not dense.requires_grad
                and [(t.shape, t.dtype, t.device) for t in (dense, embedded_sparse)] == self.signature):
            if self.probe.grad is not None:
                raise RuntimeError(
                    "the dense part replays CUDA graphs (--dense-cuda-graphs) but its parameters still "
                    "hold gradients: free them before each forward (optimizer.zero_grad(set_to_none=True)); "
                    "accumulating gradients over several backwards is not supported with the graphs")
            self.replays += 1
            return self.graphed(dense, embedded_sparse).clone()
        self.fallbacks += 1
        return self.fallback(dlrm, dense, embedded_sparse, precision, device_type)


def graph_dense(model: nn.Module, batch_size: int) -> None:
    """Capture ``model``'s (a ``CTRTrain`` / ``CTRTrainDCN`` on CUDA) training dense part (eager, or
    compiled by :func:`compile_dense` first) as CUDA graphs with ``torch.cuda.make_graphed_callables``
    for a per-rank batch of ``batch_size``: one forward and one backward graph, each one host call a
    step instead of one launch a kernel. Torch's function runs three warm-up forwards and backwards
    on a side stream (the compile, cuBLAS set-up) and then records; none touches a parameter, its
    gradient or optimizer state. The graphs read the parameters in place, so the parameters must
    keep their storage (optimizer steps and ``load_state_dict`` copy into it); each replay
    overwrites the previous step's dense gradients, so they must be consumed (the optimizer step)
    and freed (``set_to_none``; :class:`_GraphedDenseLogits` raises otherwise) before the next
    forward. The sample inputs are :func:`_dense_inputs`.

    Raises:
        ValueError: the dense part is not on a CUDA device.
    """
    probe = next(model.dense_arch.parameters())
    if probe.device.type != "cuda":
        raise ValueError(f"CUDA graphs of the dense part need its parameters on CUDA, found {probe.device}")
    fallback = model.compiled_dense_logits or dense_logits
    dense, pooled = _dense_inputs(model, batch_size, probe.device)
    graphed = torch.cuda.make_graphed_callables(_DensePart(model, fallback), (dense, pooled))
    model.compiled_dense_logits = _GraphedDenseLogits(graphed, dense, pooled, fallback, probe)


def dense_graph_calls(model: nn.Module) -> Optional[dict]:
    """``{"replays": n, "fallbacks": m}``: training calls of ``model``'s dense part that replayed
    the CUDA graphs of :func:`graph_dense` and that ran without them; None where none were
    captured."""
    graphed = model.compiled_dense_logits
    if not isinstance(graphed, _GraphedDenseLogits):
        return None
    return {"replays": graphed.replays, "fallbacks": graphed.fallbacks}


def _dense_inputs(model: nn.Module, batch_size: int, device: torch.device):
    """Zero inputs of ``model``'s dense part: dense ``[batch_size, max(num_dense, 1)]`` float32 and
    pooled embeddings ``[batch_size, F, D]`` float32 that require grad, as the sparse arch
    returns them."""
    dense = torch.zeros(batch_size, max(model.num_dense, 1), device=device)
    pooled = torch.zeros(batch_size, model.sparse_arch.F, model.sparse_arch.D, device=device,
                         requires_grad=True)
    return dense, pooled


def compiled_frames() -> int:
    """Frames ``torch.compile`` (dynamo) has compiled so far in this process, recompiles included
    (``counters["frames"]["ok"]``); 0 when dynamo was never imported."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])
