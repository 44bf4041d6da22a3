"""The lab: what measures, checks and models Lily, apart from the engine that runs the model.

* :mod:`lily.lab.doctor` (``lily doctor``) and :mod:`lily.lab.kernels` (one check per shipped
  kernel against its numpy twin, by kernel family; the kernel tests share its helpers);
* :mod:`lily.lab.bench` (``lily bench``, against MLX-LM) and :mod:`lily.lab.agent_bench`
  (``lily bench --agent``);
* :mod:`lily.lab.estimate` (``lily estimate``, the performance model) and
  :mod:`lily.lab.published` (the published figures both compare with);
* :mod:`lily.lab.system` (machine and toolchain facts for the reports);
* test support: :mod:`lily.lab.testing` (the random checkpoint factory) and
  :mod:`lily.lab.device` (numpy <-> device buffers).

The engine, the server and the native backend never import this package
(tests/test_layering.py); the CLI imports a lab module only inside the command that runs it.
"""
