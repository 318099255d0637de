"""``torchrec_ftrl.convert`` against real TensorFlow (tensorflow-cpu, requirements-tensorflow.txt).

Each test trains a small embedding in TensorFlow with FTRL (``keras.optimizers.Ftrl`` +
``tf.train.Checkpoint``, or ``tf.compat.v1.train.FtrlOptimizer`` + ``Saver``; sparse IndexedSlices
gradients from ``tf.gather`` that touch some rows; l1, l2, beta and shrinkage all non-zero, initial
accumulator 0.1), converts its checkpoint, loads it into torchrec_ftrl (the dense ``FTRL``, the fused
TBE, a ``DistributedModelParallel`` model through ``import_ftrl_tables``) and takes ONE more step
from the same gradient on both sides: weights and both slots agree within fp32 tolerance. The
expected values always come from TensorFlow, the knob mapping from docs/convert.md (:data:`KNOB`).

Semantics compared like with like: tf.compat.v1 sums repeated ids and updates only the touched rows,
as the fused TBE does; Keras 3 updates every row (compared with ``FTRL(skip_zero_grad_rows=False)``
on the dense gradient, or with the TBE on a batch holding every row) and squares repeated ids one
by one (its compared steps use unique ids; ``test_keras_repeated_ids`` pins that difference).
TensorFlow is imported once, by the ``tf`` fixture.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchrec_ftrl
from conftest import REPO, device_type
from torchrec_ftrl import convert

ROWS, DIM = 12, 4          # table "wide" (Keras) / "ta" (v1)
ROWS_B, DIM_B = 7, 3       # table "tb" (v1)
STEPS = 3                  # TensorFlow steps before the checkpoint
TOL = dict(rtol=2e-5, atol=2e-6)

KERAS = dict(learning_rate=0.1, learning_rate_power=-0.4, initial_accumulator_value=0.1,
             l1_regularization_strength=0.01, l2_regularization_strength=0.02,
             l2_shrinkage_regularization_strength=0.03, beta=0.5)
V1 = dict(learning_rate=0.2, learning_rate_power=-0.5, initial_accumulator_value=0.1,
          l1_regularization_strength=0.02, l2_regularization_strength=0.01,
          l2_shrinkage_regularization_strength=0.05, beta=0.3)
# TensorFlow argument -> torchrec_ftrl knob (docs/convert.md), stated independently of the converter.
KNOB = {"learning_rate": "learning_rate", "learning_rate_power": "ftrl_learning_rate_power",
        "initial_accumulator_value": "ftrl_initial_accumulator_value",
        "l1_regularization_strength": "ftrl_l1_reg", "l2_regularization_strength": "ftrl_l2_reg",
        "l2_shrinkage_regularization_strength": "ftrl_l2_shrinkage", "beta": "ftrl_beta"}


def fused_of(tf_knobs: dict) -> dict:
    """The torchrec_ftrl knobs equivalent to TensorFlow-named hyperparameters (docs/convert.md)."""
    return {**{KNOB[k]: v for k, v in tf_knobs.items()}, "ftrl_l2_convention": "tensorflow"}


def flags(tf_knobs: dict, skip=()) -> list[str]:
    return [a for k, v in tf_knobs.items() if k not in skip for a in ("--" + k.replace("_", "-"), repr(v))]


# ---------------------------------------------------------------------------------------- batches


@dataclasses.dataclass
class Batch:
    """One feature's bags (SUM pooling): ids, offsets and the gradient of each pooled bag."""

    ids: np.ndarray      # int64 [N]
    offsets: np.ndarray  # int64 [B + 1]
    up: np.ndarray       # fp32 [B, D]

    @property
    def up_ids(self) -> np.ndarray:
        """The gradient reaching each looked-up row occurrence: its bag's gradient."""
        return np.repeat(self.up, np.diff(self.offsets), axis=0)

    def row_grad(self, rows: int) -> np.ndarray:
        """Dense ``[rows, D]`` gradient, duplicates summed."""
        g = np.zeros((rows, self.up.shape[1]), np.float32)
        np.add.at(g, self.ids, self.up_ids)
        return g


def make_batch(seed: int, rows: int, dim: int, bags: int = 5, hi: int | None = None,
               cover: bool = False, unique: bool = False) -> Batch:
    """``bags`` non-empty bags of ids in ``[0, hi)``, with repeated ids unless ``unique``; ``cover``:
    every row appears (once if ``unique``)."""
    rng = np.random.default_rng(seed)
    hi = rows if hi is None else hi
    if cover:
        ids = np.concatenate([rng.permutation(rows), [] if unique else rng.integers(0, rows, size=3)])
    elif unique:
        ids = rng.choice(hi, size=int(rng.integers(bags, hi + 1)), replace=False)
    else:
        ids = rng.integers(0, hi, size=int(rng.integers(bags + 2, 3 * bags)))
    cuts = np.sort(rng.choice(np.arange(1, len(ids)), size=bags - 1, replace=False))
    offsets = np.concatenate([[0], cuts, [len(ids)]]).astype(np.int64)
    return Batch(ids.astype(np.int64), offsets, rng.normal(size=(bags, dim)).astype(np.float32))


# -------------------------------------------------------------------------------- TensorFlow side


@pytest.fixture(scope="module")
def tf():
    with pytest.MonkeyPatch.context() as mp:  # quiet start-up (read once, at import)
        mp.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
        mp.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
        return pytest.importorskip("tensorflow", reason="needs TensorFlow (requirements-tensorflow.txt)")


class KerasProgram:
    """A Keras 3 program: ``model.other`` (dense, trained first) and the table ``model.emb``,
    ``keras.optimizers.Ftrl``, saved with ``tf.train.Checkpoint(model=..., optimizer=...)``."""

    def __init__(self, tf, seed: int, **knobs):
        import keras
        rng = np.random.default_rng(seed)
        self.tf = tf
        self.model = tf.Module()
        self.model.other = keras.Variable(rng.normal(size=(3, 2)).astype(np.float32), name="dense_kernel")
        self.model.emb = keras.Variable(rng.uniform(-0.05, 0.05, (ROWS, DIM)).astype(np.float32), name="emb")
        self.opt = keras.optimizers.Ftrl(**{**KERAS, **knobs})
        self.ckpt = tf.train.Checkpoint(model=self.model, optimizer=self.opt)

    def step(self, batch: Batch) -> None:
        tf, variables = self.tf, [self.model.other, self.model.emb]
        with tf.GradientTape() as tape:
            loss = (tf.reduce_sum(tf.gather(self.model.emb, batch.ids) * batch.up_ids)
                    + tf.reduce_sum(tf.square(self.model.other)))
        grads = tape.gradient(loss, variables)
        assert isinstance(grads[1], tf.IndexedSlices)
        self.opt.apply_gradients(zip(grads, variables))

    def state(self):
        slots = {v.name: v for v in self.opt.variables}
        return (self.model.emb.numpy(), slots["emb_accumulator"].numpy(), slots["emb_linear"].numpy())


class V1Program:
    """A TF1 graph: ``wide/emb_a``, ``emb_b`` (tables) and ``unused`` (no optimizer),
    ``tf.compat.v1.train.FtrlOptimizer`` on sparse gradients, ``tf.compat.v1.train.Saver``."""

    def __init__(self, tf, seed: int):
        v1 = self.v1 = tf.compat.v1
        rng = np.random.default_rng(seed)
        self.graph = tf.Graph()
        with self.graph.as_default():
            init = {s: rng.uniform(-0.05, 0.05, s).astype(np.float32) for s in ((ROWS, DIM), (ROWS_B, DIM_B))}
            with v1.variable_scope("wide"):
                self.emb_a = v1.get_variable("emb_a", initializer=init[ROWS, DIM])
            self.emb_b = v1.get_variable("emb_b", initializer=init[ROWS_B, DIM_B])
            v1.get_variable("unused", initializer=np.zeros((2, 2), np.float32))
            self.ph = {k: (v1.placeholder(tf.int64, [None]), v1.placeholder(tf.float32, [None, d]))
                       for k, d in (("a", DIM), ("b", DIM_B))}
            loss = (tf.reduce_sum(tf.gather(self.emb_a, self.ph["a"][0]) * self.ph["a"][1])
                    + tf.reduce_sum(tf.gather(self.emb_b, self.ph["b"][0]) * self.ph["b"][1]))
            self.opt = v1.train.FtrlOptimizer(**V1)
            self.train = self.opt.minimize(loss, var_list=[self.emb_a, self.emb_b])
            self.tensors = [[v, self.opt.get_slot(v, "accum"), self.opt.get_slot(v, "linear")]
                            for v in (self.emb_a, self.emb_b)]
            self.saver = v1.train.Saver()
            self.sess = v1.Session(graph=self.graph)
            self.sess.run(v1.global_variables_initializer())

    def save(self, prefix: str) -> str:
        with self.graph.as_default():
            return self.saver.save(self.sess, prefix)

    def restore(self, prefix: str, var_list=None) -> None:
        with self.graph.as_default():
            saver = self.saver if var_list is None else self.v1.train.Saver(var_list=var_list)
            saver.restore(self.sess, str(prefix))

    def step(self, ba: Batch, bb: Batch) -> None:
        self.sess.run(self.train, {self.ph["a"][0]: ba.ids, self.ph["a"][1]: ba.up_ids,
                                   self.ph["b"][0]: bb.ids, self.ph["b"][1]: bb.up_ids})

    def state(self):
        return [tuple(x) for x in self.sess.run(self.tensors)]


@pytest.fixture(scope="module")
def keras_ckpt(tf, tmp_path_factory):
    """(program, checkpoint path, saved (w, accum, linear)) after STEPS Keras steps; rows >= ROWS-3
    never appear in a batch."""
    prog = KerasProgram(tf, seed=1)
    for s in range(STEPS):
        prog.step(make_batch(10 + s, ROWS, DIM, hi=ROWS - 3))
    path = prog.ckpt.save(str(tmp_path_factory.mktemp("keras") / "ckpt"))
    return prog, path, prog.state()


@pytest.fixture(scope="module")
def v1_ckpt(tf, tmp_path_factory):
    """(program, checkpoint path, saved [(w, accum, linear)] of emb_a, emb_b) after STEPS steps."""
    prog = V1Program(tf, seed=2)
    for s in range(STEPS):
        prog.step(make_batch(20 + s, ROWS, DIM, hi=ROWS - 3), make_batch(30 + s, ROWS_B, DIM_B, hi=ROWS_B - 2))
    path = prog.save(str(tmp_path_factory.mktemp("v1") / "model"))
    return prog, path, prog.state()


# --------------------------------------------------------------------------------- torchrec side


def dense_ftrl_step(state, grad, fused: dict):
    """One ``torchrec_ftrl.FTRL`` step on a parameter holding ``state`` (w, accum, linear); ``grad``
    is a dense array (every element updated, Keras' semantics: ``skip_zero_grad_rows=False``) or a
    ``Batch`` (then a sparse COO gradient: touched rows only)."""
    w, n, z = state
    p = torch.nn.Parameter(torch.from_numpy(w.copy()))
    # fused_params as printed ("optimizer" is ignored by the dense optimizer).
    opt = torchrec_ftrl.FTRL([p], **fused, skip_zero_grad_rows=False)
    opt.state[p].update(step=torch.tensor(0.0), accum=torch.from_numpy(n.copy()),
                        linear=torch.from_numpy(z.copy()))
    if isinstance(grad, Batch):
        p.grad = torch.sparse_coo_tensor(torch.from_numpy(grad.ids)[None], torch.from_numpy(grad.up_ids), w.shape,
                                         check_invariants=True)
    else:
        p.grad = torch.from_numpy(grad)
    opt.step()
    return p.detach().numpy(), opt.state[p]["accum"].numpy(), opt.state[p]["linear"].numpy()


def tbe_step(states, batches, fused: dict):
    """One fused step of ``FTRLTableBatchedEmbeddingBags`` (one feature per table, SUM pooling)
    loaded with ``states`` through ``split_embedding_weights`` / ``split_optimizer_states``."""
    knobs = {k: v for k, v in fused.items() if k != "optimizer"}
    tbe = torchrec_ftrl.FTRLTableBatchedEmbeddingBags([tuple(map(int, s[0].shape)) for s in states], **knobs)
    with torch.no_grad():
        for (w, n, z), W, (A, L) in zip(states, tbe.split_embedding_weights(), tbe.split_optimizer_states()):
            W.copy_(torch.from_numpy(w))
            A.copy_(torch.from_numpy(n))
            L.copy_(torch.from_numpy(z))
    indices = np.concatenate([b.ids for b in batches])
    starts = np.cumsum([0] + [len(b.ids) for b in batches[:-1]])
    offsets = np.concatenate([b.offsets[:-1] + s for b, s in zip(batches, starts)] + [[len(indices)]])
    out = tbe(torch.from_numpy(indices), torch.from_numpy(offsets))
    out.backward(torch.from_numpy(np.concatenate([b.up for b in batches], axis=1)))
    return [(W.detach().numpy().copy(), A.numpy().copy(), L.numpy().copy())
            for W, (A, L) in zip(tbe.split_embedding_weights(), tbe.split_optimizer_states())]


def assert_state_close(got, expected, what: str) -> None:
    for name, g, e in zip(("weight", "accum", "linear"), got, expected):
        np.testing.assert_allclose(g, e, err_msg=f"{what}: {name}", **TOL)


def assert_file_holds(path, tables: dict) -> None:
    """The export file at ``path`` holds exactly ``{name: (w, accum, linear)}``, bit for bit, fp32."""
    with np.load(path) as f:
        assert sorted(f.files) == sorted(k for t in tables for k in (t, f"{t}/accum", f"{t}/linear"))
        for t, (w, n, z) in tables.items():
            for key, e in ((t, w), (f"{t}/accum", n), (f"{t}/linear", z)):
                assert f[key].dtype == np.float32 and np.array_equal(f[key], e), key


def load_file(path, table: str):
    with np.load(path) as f:
        return f[table], f[f"{table}/accum"], f[f"{table}/linear"]


# ------------------------------------------------------------------------------------------ Keras


def test_keras_from_tensorflow(tf, keras_ckpt, tmp_path, capsys):
    """Keras checkpoint -> CLI -> dense FTRL (a step touching some rows: Keras updates every row)
    and the fused TBE (a step touching every row, where the two semantics coincide)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    prog, path, saved = keras_ckpt
    out = tmp_path / "wide.npz"
    # The learning rate is stored in the checkpoint; the other knobs are flags.
    rc = convert.main(["from-tensorflow", path, "--table", "wide=model/emb", "--out", str(out),
                       *flags(KERAS, skip=("learning_rate",))])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "flavour keras" in text and "learning_rate = 0.1  (stored in the checkpoint" in text, text
    assert "beta = 0.5  (--beta)" in text and f"optimizer iterations in the checkpoint: {STEPS}" in text
    assert "squares each occurrence" in text  # Keras 3 and repeated ids
    assert "note: keras.optimizers.Ftrl applies sparse" in text  # l2 shrinkage > 0
    line = [x for x in text.splitlines() if x.startswith("fused_params = ")][0]
    fused = eval(line[len("fused_params = "):], {"EmbOptimType": EmbOptimType})  # noqa: S307 (pasteable)
    assert fused == {"optimizer": EmbOptimType.FTRL, **fused_of(KERAS)}
    assert_file_holds(out, {"wide": saved})

    # Step A: some rows; Keras' dense update == FTRL with the dense gradient (all rows change).
    batch = make_batch(100, ROWS, DIM, hi=ROWS - 4, unique=True)
    prog.ckpt.restore(path)
    prog.step(batch)
    expected = prog.state()
    untouched = np.setdiff1d(np.arange(ROWS), batch.ids)
    assert not np.array_equal(expected[2][untouched], saved[2][untouched])  # they moved (shrinkage)
    assert_state_close(dense_ftrl_step(load_file(out, "wide"), batch.row_grad(ROWS), fused), expected,
                       "dense FTRL vs Keras")

    # Step B: every row in the batch; the fused TBE (touched rows only) == Keras.
    batch = make_batch(101, ROWS, DIM, cover=True, unique=True)
    prog.ckpt.restore(path)
    prog.step(batch)
    assert_state_close(tbe_step([load_file(out, "wide")], [batch], fused)[0], prog.state(), "TBE vs Keras")


def test_keras_to_tensorflow(tf, tmp_path, capsys):
    """torchrec_ftrl state -> to-tensorflow into the template of a Keras program -> that program
    restores it (learning rate from the flag) and one Keras step == one dense FTRL step."""
    rng = np.random.default_rng(5)
    fused = fused_of(KERAS)
    state = (rng.uniform(-0.05, 0.05, (ROWS, DIM)).astype(np.float32),
             np.full((ROWS, DIM), 0.1, np.float32), np.zeros((ROWS, DIM), np.float32))
    for s in range(2):  # train in torchrec_ftrl first (dense gradients, Keras semantics)
        state = dense_ftrl_step(state, make_batch(40 + s, ROWS, DIM).row_grad(ROWS), fused)
    export = tmp_path / "tables.npz"
    np.savez(export, **{"wide": state[0], "wide/accum": state[1], "wide/linear": state[2]})

    template = KerasProgram(tf, seed=6, learning_rate=0.05)  # the destination program, not yet trained
    template.opt.build([template.model.other, template.model.emb])
    template.ckpt.write(str(tmp_path / "template"))
    out = tmp_path / "restored"
    rc = convert.main(["to-tensorflow", str(export), "--table", "wide=model/emb", "--template",
                       str(tmp_path / "template"), "--out", str(out), *flags(KERAS)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "optimizer = keras.optimizers.Ftrl(learning_rate=0.1, learning_rate_power=-0.4" in text, text

    prog = KerasProgram(tf, seed=7, learning_rate=0.05)  # a fresh run of that program
    prog.ckpt.restore(str(out))  # deferred for the optimizer: its slots are filled when it builds
    assert np.array_equal(prog.model.emb.numpy(), state[0])
    assert np.array_equal(prog.model.other.numpy(), template.model.other.numpy())  # copied
    batch = make_batch(50, ROWS, DIM, hi=ROWS - 2, unique=True)
    prog.step(batch)
    assert float(prog.opt.learning_rate) == pytest.approx(0.1)
    assert_state_close(prog.state(), dense_ftrl_step(state, batch.row_grad(ROWS), fused),
                       "Keras after to-tensorflow vs dense FTRL")


def test_keras_repeated_ids(tf):
    """Pins the Keras 3 behaviour docs/convert.md describes: with an id twice in one IndexedSlices
    gradient, Keras adds each occurrence's square to accum (1 + 4), where torchrec_ftrl and
    tf.compat.v1 add the square of the sum (9). Only such rows differ; unique ids agree."""
    import keras
    var = keras.Variable(np.zeros((3, 1), np.float32))
    opt = keras.optimizers.Ftrl(learning_rate=1.0, initial_accumulator_value=0.0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(var, [0, 0, 1]) * tf.constant([[1.0], [2.0], [5.0]]))
    opt.apply_gradients(zip(tape.gradient(loss, [var]), [var]))
    accum = {v.name: v for v in opt.variables}[f"{var.name}_accumulator"].numpy().ravel()
    np.testing.assert_array_equal(accum, [5.0, 25.0, 0.0])
    batch = Batch(np.array([0, 0, 1]), np.array([0, 1, 2, 3]), np.array([[1.0], [2.0], [5.0]], np.float32))
    zeros = np.zeros((3, 1), np.float32)
    got = dense_ftrl_step((zeros, zeros, zeros), batch, fused_of({"learning_rate": 1.0,
                                                                  "initial_accumulator_value": 0.0}))
    np.testing.assert_array_equal(got[1].ravel(), [9.0, 25.0, 0.0])


def test_object_based_slot_variables(tf, tmp_path):
    """tf.compat.v1.train.FtrlOptimizer under tf.train.Checkpoint (eager): the object graph links
    the slots through ``slot_variables``; found by name, converted bit for bit."""
    emb = tf.Variable(np.random.default_rng(8).normal(size=(5, 2)).astype(np.float32), name="emb")
    opt = tf.compat.v1.train.FtrlOptimizer(0.1, l1_regularization_strength=0.01)
    for s in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [s, s + 2]) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [emb]), [emb]))
    model = tf.Module()
    model.emb = emb
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    result = convert.from_tensorflow(path, {"t": "emb"}, tmp_path / "t.npz", hyperparams={"learning_rate": 0.1})
    assert result.flavour == "keras" and result.tables[0].layout == "slot_variables" and not result.notes
    assert_file_holds(tmp_path / "t.npz", {"t": (emb.numpy(), opt.get_slot(emb, "accum").numpy(),
                                                 opt.get_slot(emb, "linear").numpy())})


# --------------------------------------------------------------------------------------------- v1


def test_v1_from_tensorflow_tbe(tf, v1_ckpt, tmp_path):
    """TF1 name-based checkpoint, two tables -> export file -> the fused TBE; one sparse TF1 step ==
    one TBE step (untouched rows unchanged on both sides)."""
    prog, path, saved = v1_ckpt
    out = tmp_path / "tables.safetensors"
    result = convert.from_tensorflow(path, {"ta": "wide/emb_a", "tb": "emb_b"}, out, hyperparams=V1)
    assert result.flavour == "v1" and result.sources["learning_rate"] == "--learning-rate"
    assert [(t.name, t.accum_key, t.linear_key) for t in result.tables] == [
        ("ta", "wide/emb_a/Ftrl", "wide/emb_a/Ftrl_1"), ("tb", "emb_b/Ftrl", "emb_b/Ftrl_1")]
    from safetensors.numpy import load_file as load_st
    arrays = load_st(str(out))
    states = [tuple(arrays[k] for k in (t, f"{t}/accum", f"{t}/linear")) for t in ("ta", "tb")]
    for got, exp in zip(states, saved):
        assert all(np.array_equal(g, e) for g, e in zip(got, exp))

    ba, bb = make_batch(200, ROWS, DIM, hi=ROWS - 2), make_batch(201, ROWS_B, DIM_B, hi=ROWS_B - 1)
    prog.restore(path)
    prog.step(ba, bb)
    expected = prog.state()
    assert np.array_equal(expected[0][0][-1], saved[0][0][-1])  # sparse: untouched rows unchanged
    got = tbe_step(states, [ba, bb], result.fused_params())
    for t, g, e in zip(("ta", "tb"), got, expected):
        assert_state_close(g, e, f"TBE vs tf.compat.v1 ({t})")


def _dmp_step(rank: int, world_size: int, work: str) -> None:
    """Worker: a DMP model (row-wise + table-wise FTRL tables) loads ``from_tf.npz`` with
    ``import_ftrl_tables``, takes one step on ``batch.npz``, exports ``after.npz``."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec_ftrl.checkpoint import export_ftrl_tables, import_ftrl_tables

    with open(os.path.join(work, "dmp.json")) as fh:
        spec = json.load(fh)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=t, embedding_dim=d, num_embeddings=r, feature_names=[f]) for t, f, r, d in spec["tables"]],
        device=torch.device("meta"))
    sharders = torchrec_ftrl.sharders({"optimizer": EmbOptimType.FTRL, **spec["fused"]})
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding={"ta": row_wise(), "tb": table_wise(rank=0)}, sharder=sharders[0],
        local_size=world_size, world_size=world_size, device_type=device_type())
    for ps in plan.values():
        ps.compute_kernel = "fused"
    device = torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")
    dmp = DistributedModelParallel(ebc, device=device, sharders=sharders, plan=ShardingPlan({"": plan}))
    import_ftrl_tables(dmp, os.path.join(work, "from_tf.npz"))
    b = np.load(os.path.join(work, "batch.npz"))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f for _, f, _, _ in spec["tables"]], values=torch.from_numpy(b["values"]),
        lengths=torch.from_numpy(b["lengths"])).to(device)
    (dmp(kjt).values() * torch.from_numpy(b["up"]).to(device)).sum().backward()
    export_ftrl_tables(dmp, os.path.join(work, "after.npz"))


@pytest.mark.slow
def test_v1_dmp_round_trip(tf, v1_ckpt, tmp_path, run_distributed):
    """TF1 checkpoint -> import_ftrl_tables into DMP (1 gloo process) -> one step == one TF1 step ->
    export_ftrl_tables -> to-tensorflow (template: the TF1 checkpoint) -> Saver.restore -> one TF1
    step == one dense FTRL step (sparse gradient)."""
    prog, path, saved = v1_ckpt
    work = str(tmp_path)
    result = convert.from_tensorflow(path, ["ta=wide/emb_a", "tb=emb_b:0"], tmp_path / "from_tf.npz",
                                     flavour="v1", hyperparams=V1)
    fused = result.hyperparams.to_options()
    ba, bb = make_batch(300, ROWS, DIM, hi=ROWS - 2), make_batch(301, ROWS_B, DIM_B, hi=ROWS_B - 1)
    np.savez(tmp_path / "batch.npz", values=np.concatenate([ba.ids, bb.ids]),
             lengths=np.concatenate([np.diff(ba.offsets), np.diff(bb.offsets)]),
             up=np.concatenate([ba.up, bb.up], axis=1))
    with open(tmp_path / "dmp.json", "w") as fh:
        json.dump({"tables": [["ta", "fa", ROWS, DIM], ["tb", "fb", ROWS_B, DIM_B]], "fused": fused}, fh)
    run_distributed(_dmp_step, 1, work)

    prog.restore(path)
    prog.step(ba, bb)
    expected = prog.state()
    for t, e in zip(("ta", "tb"), expected):
        assert_state_close(load_file(tmp_path / "after.npz", t), e, f"DMP vs tf.compat.v1 ({t})")

    # Back to TensorFlow, into the same program's checkpoint layout.
    back = tmp_path / "back"
    convert.to_tensorflow(tmp_path / "after.npz", {"ta": "wide/emb_a", "tb": "emb_b"}, back,
                          template=path, hyperparams=V1)
    assert sorted(n for n, _ in tf.train.list_variables(str(back))) == sorted(
        n for n, _ in tf.train.list_variables(path))
    prog.restore(back)
    restored = prog.state()
    for t, r in zip(("ta", "tb"), restored):
        assert all(np.array_equal(x, y) for x, y in zip(r, load_file(tmp_path / "after.npz", t)))
    ca, cb = make_batch(400, ROWS, DIM, hi=ROWS - 1), make_batch(401, ROWS_B, DIM_B)
    prog.step(ca, cb)
    for t, r, c, e in zip(("ta", "tb"), restored, (ca, cb), prog.state()):
        assert_state_close(dense_ftrl_step(r, c, fused), e, f"tf.compat.v1 after to-tensorflow ({t})")

    # Without a template: just the tables and their slots, restorable by name.
    bare = tmp_path / "bare"
    convert.to_tensorflow(tmp_path / "after.npz", {"ta": "wide/emb_a"}, bare, flavour="v1",
                          hyperparams={"learning_rate": 0.2})
    assert dict(tf.train.list_variables(str(bare))) == {
        "wide/emb_a": [ROWS, DIM], "wide/emb_a/Ftrl": [ROWS, DIM], "wide/emb_a/Ftrl_1": [ROWS, DIM]}
    prog.restore(bare, var_list=prog.tensors[0])
    for x, y in zip(prog.sess.run(prog.tensors[0]), load_file(tmp_path / "after.npz", "ta")):
        assert np.array_equal(x, y)


# ----------------------------------------------------------------------------------------- errors


def _no_outputs(tmp_path) -> bool:
    return not [p for p in glob.glob(str(tmp_path / "out*")) + glob.glob(str(tmp_path / ".tmp*"))]


def test_refused(tf, keras_ckpt, v1_ckpt, tmp_path):
    """Name and shape mismatches raise ValueError naming the table, and nothing is written."""
    _, kpath, ksaved = keras_ckpt
    _, vpath, _ = v1_ckpt
    cases = [
        (lambda: convert.from_tensorflow(kpath, {"wide": "model/nope"}, tmp_path / "out.npz"),
         r"table 'wide'.*no variable 'model/nope'"),
        (lambda: convert.from_tensorflow(vpath, {"ta": "wide/emb_x"}, tmp_path / "out.npz", hyperparams=V1),
         r"table 'ta'.*no variable 'wide/emb_x'"),
        (lambda: convert.from_tensorflow(vpath, {"ta": "wide/emb_a", "u": "unused"}, tmp_path / "out.npz",
                                         hyperparams=V1),
         r"table 'u'.*'unused' has no FTRL slot 'unused/Ftrl'"),
        (lambda: convert.from_tensorflow(vpath, {"ta": "wide/emb_a"}, tmp_path / "out.npz"),
         r"--learning-rate is required"),
        (lambda: convert.from_tensorflow(kpath, {"wide": "model/emb"}, tmp_path / "out.npz", flavour="v1"),
         r"is a keras checkpoint"),
        (lambda: convert.from_tensorflow(kpath, {"wide": "model/emb"}, tmp_path / "out.npz",
                                         hyperparams={"l1_regularization_strength": -1.0}),
         r"ftrl_l1_reg must be >= 0"),
    ]
    export = tmp_path / "export.npz"
    w, n, z = ksaved
    np.savez(export, **{"wide": w, "wide/accum": n, "wide/linear": z,
                        "tall": np.zeros((ROWS + 1, DIM), np.float32),
                        "tall/accum": np.zeros((ROWS + 1, DIM), np.float32),
                        "tall/linear": np.zeros((ROWS + 1, DIM), np.float32),
                        "rw": w, "rw/accum": n[:, 0].copy(), "rw/linear": z})
    cases += [
        (lambda: convert.to_tensorflow(export, {"tall": "model/emb"}, tmp_path / "out", template=kpath),
         r"table 'tall': export-file shape \[13, 4\] != shape \[12, 4\] of 'model/emb'"),
        (lambda: convert.to_tensorflow(export, {"wide": "model/emb", "gone": "model/other"}, tmp_path / "out",
                                       template=kpath),
         r"table 'gone'.*has no 'gone'"),
        (lambda: convert.to_tensorflow(export, {"wide": "model/emb"}, tmp_path / "out"),
         r"--flavour keras needs --template"),
        (lambda: convert.to_tensorflow(export, {"tall": "wide/emb_a"}, tmp_path / "out", template=vpath,
                                       hyperparams=V1),
         r"table 'tall': export-file shape \[13, 4\] != shape \[12, 4\] of 'wide/emb_a'"),
        (lambda: convert.to_tensorflow(export, {"rw": "model/emb"}, tmp_path / "out", template=kpath),
         r"table 'rw': 'rw/accum' has shape \[12\], one accum per row \(ftrl_accumulator='rowwise'\); "
         r"TensorFlow's Ftrl keeps one per element"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()
        assert _no_outputs(tmp_path), pattern


def test_cli_error_is_one_line(tf, keras_ckpt, tmp_path, capsys):
    _, path, _ = keras_ckpt
    rc = convert.main(["from-tensorflow", path, "--table", "wide=model/nope", "--out", str(tmp_path / "out.npz")])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: table 'wide'"), captured.err
    assert _no_outputs(tmp_path)


def test_without_tensorflow(tmp_path):
    """``import torchrec_ftrl`` (and ``torchrec_ftrl.convert``) never imports TensorFlow; without it,
    ``python -m torchrec_ftrl.convert`` prints one line saying what to install and exits 2."""
    code = ("import runpy, sys\n"
            "import torchrec_ftrl, torchrec_ftrl.convert\n"
            "bad = [m for m in ('tensorflow', 'keras') if m in sys.modules]\n"
            "assert not bad, f'imported {bad}'\n"
            "del sys.modules['torchrec_ftrl.convert']\n"
            "sys.modules['tensorflow'] = None  # as if not installed\n"
            "sys.argv = ['torchrec_ftrl.convert'] + sys.argv[1:]\n"
            "runpy.run_module('torchrec_ftrl.convert', run_name='__main__', alter_sys=True)\n")
    out = tmp_path / "out.npz"
    proc = subprocess.run([sys.executable, "-c", code, "from-tensorflow", str(tmp_path / "ckpt"),
                           "--table", "t=emb", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: TensorFlow is not installed"), proc.stderr
    assert "torchrec-ftrl[tensorflow]" in lines[0] and proc.stdout == "" and not out.exists()
