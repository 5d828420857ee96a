from rlhf_lightning.callbacks.adapters import AdapterExport
from rlhf_lightning.callbacks.samples import SampleTable

__all__ = ["AdapterExport", "SampleTable"]
