from rlhf_lightning.callbacks.adapters import AdapterExport
from rlhf_lightning.callbacks.ranks import SameConfigOnAllRanks, config_digest
from rlhf_lightning.callbacks.samples import SampleTable

__all__ = ["AdapterExport", "SameConfigOnAllRanks", "SampleTable", "config_digest"]
