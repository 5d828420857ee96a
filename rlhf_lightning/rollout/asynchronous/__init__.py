"""Asynchronous rollouts (``rollout.mode=async``): one driver (:mod:`.driver`) over transports
(the producer process, :mod:`.process` + :mod:`.producer`; the inference servers,
:mod:`.servers`); the version plan they follow is :mod:`.plan`."""
