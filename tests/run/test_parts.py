"""The parts a run and its rollout producer both build (``rlhf_lightning.run.parts``)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

# What a producer process does (rollout.mode=async): unpickle its ProducerBuild, build the parts.
PRODUCER = """
import pickle, sys
from omegaconf import OmegaConf
sys.path.insert(0, {root!r})
from tests.conftest import compose_config
from rlhf_lightning.run.parts import ProducerBuild
from rlhf_lightning.rollout.asynchronous.plan import Placement

build = pickle.loads(pickle.dumps(ProducerBuild(OmegaConf.to_yaml(compose_config(['rollout.mode=async']), resolve=True))))
harness, engine, policy = build(Placement())
print(type(engine).__name__, 'lightning' in sys.modules)
"""


def test_a_producer_builds_its_parts_without_importing_lightning():
    """Lightning (and torchmetrics, scipy, transformers' auto classes it imports) cost a producer
    ~2 s of start-up it never uses."""
    code = PRODUCER.format(root=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "HFEngine False"
