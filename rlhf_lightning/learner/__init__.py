"""The update machinery of rollout algorithms, below the families that use it: the rank-safe
update plan and micro-batches (``plan``, ``microbatch``), scoring (``scoring``), the records
between stages (``records``), the micro-batch objective and its Liger twin (``objective``,
``objective_build``, ``liger_path``), the critic's steps (``critic``) and the optimizer step's
parts (``optimizer``)."""
