"""Plans and trains a stock-optimizer TorchRec model (no FTRL table) in one CPU process and prints one
JSON line: the plan and a digest of every weight and optimizer state after 3 steps.

``python tests/stock_model_probe.py 0`` runs it without ``import torchrec_ftrl``, ``... 1`` with it
(imported before the model is built, as a user's script does): ``test_package_scope`` compares them.
"""

import hashlib
import json
import sys

import torch
import torch.distributed as dist

if sys.argv[1] == "1":
    import torchrec_ftrl  # noqa: F401

from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8 * (i + 1), num_embeddings=40 + 10 * i,
                                 feature_names=[f"f{i}"]) for i in range(3)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3})
    # One table per sharding type the CPU planner offers a fused kernel for; t2 is the planner's choice.
    constraints = {"t0": ParameterConstraints(sharding_types=["table_wise"]),
                   "t1": ParameterConstraints(sharding_types=["column_wise"])}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        lengths = torch.randint(0, 4, (3 * 5,), generator=gen)
        values = torch.cat([torch.randint(0, 40 + 10 * (k // 5), (int(n),), generator=gen)
                            for k, n in enumerate(lengths)])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=values, lengths=lengths)
        out = model(kjt).values()
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    digest = hashlib.sha256()
    names = []

    def visit(name, value):
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                visit(f"{name}/{key}", value[key])
            return
        if hasattr(value, "local_shards"):
            value = torch.cat([s.tensor.flatten() for s in value.local_shards()])
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
            names.append(name)

    visit("model", model.state_dict())
    visit("optimizer", model.fused_optimizer.state_dict()["state"])
    print(json.dumps({"plan": str(plan), "state": names, "digest": digest.hexdigest()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
