"""The kernel twins: for each shipped kernel a numpy model of what it computes and an encoder
of its dispatch, by kernel family as ``metal/`` and ``tests/kernels/`` are split.

* :mod:`~lily.lab.kernels.harness`: one dispatch, random quantized tensors, operand rounding
  models, error ratios and :func:`~lily.lab.kernels.harness.check` (argument structs are
  packed by :func:`lily.lab.device.pack_args`);
* one module per family: :mod:`~lily.lab.kernels.gemv`, :mod:`~lily.lab.kernels.gemm`,
  :mod:`~lily.lab.kernels.embed`, :mod:`~lily.lab.kernels.norm`, :mod:`~lily.lab.kernels.moe`,
  :mod:`~lily.lab.kernels.moe_prefill`, :mod:`~lily.lab.kernels.gdn`,
  :mod:`~lily.lab.kernels.gdn_prefill`, :mod:`~lily.lab.kernels.attention`,
  :mod:`~lily.lab.kernels.attention_prefill`, :mod:`~lily.lab.kernels.sample`;
* :mod:`~lily.lab.kernels.registry`: the checks ``lily doctor`` runs, one per shipped kernel.

Every check dispatches one kernel on a native device (``metal``, or ``sim`` on Linux) with
small fresh random inputs and compares with a float64 numpy evaluation against the same
first-order error bounds the kernel tests use (tests/kernels/ import these helpers through
tests/harness.py: one home for them).
"""
