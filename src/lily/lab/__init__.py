"""The lab: what measures, checks and models Lily, apart from the engine that runs the model.

* :mod:`lily.lab.doctor` (``lily doctor``) and :mod:`lily.lab.kernels` (one check per shipped
  kernel against its numpy twin, by kernel family; the kernel tests share its helpers);
* :mod:`lily.lab.bench` (``lily bench``, against MLX-LM), :mod:`lily.lab.agent_bench`
  (``lily bench --agent``), :mod:`lily.lab.concurrent_bench` (``lily bench --concurrent``:
  N requests at once on one engine) and :mod:`lily.lab.kernel_bench` (``lily bench
  --kernels``: each hot kernel timed alone against its roofline);
* :mod:`lily.lab.estimate` (``lily estimate``, the performance model),
  :mod:`lily.lab.calibration` (the published measurements it is calibrated on, and how),
  :mod:`lily.lab.tensor_rate` (the tensor-op efficiency fitted to engines measured on M5) and
  :mod:`lily.lab.published` (the published figures both compare with);
* :mod:`lily.lab.system` (machine and toolchain facts for the reports);
* test support: :mod:`lily.lab.testing` (the random checkpoint factory) and
  :mod:`lily.lab.device` (numpy <-> device buffers).

The engine, the server and the native backend never import this package
(tests/test_layering.py); the CLI imports a lab module only inside the command that runs it.
"""
