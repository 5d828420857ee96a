"""Each rank's colocated engine learns its rank from the trainer (no vLLM needed: nothing starts)."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf_lightning.rollout.engines.callback import RolloutEngineCallback
from rlhf_lightning.rollout.engines.vllm import VLLMEngine


def test_engine_takes_its_rank_from_the_trainer(tmp_path):
    engine = VLLMEngine("unused", lora_rank=8, lora_staging_dir=str(tmp_path), seed=3)
    assert engine.rank == 0 and engine.staging_dir == tmp_path
    trainer = SimpleNamespace(global_rank=1, world_size=2, local_rank=1)
    callback = RolloutEngineCallback()
    for stage in ("validate", "fit"):  # run() validates before fitting: binding twice is harmless
        callback.setup(trainer, SimpleNamespace(engine=engine), stage)  # type: ignore[arg-type]
    assert (engine.rank, engine.world_size, engine.local_rank) == (1, 2, 1)
    assert engine.staging_dir == tmp_path / "rank_1"
    assert engine.seed == 4  # its own sampling stream
