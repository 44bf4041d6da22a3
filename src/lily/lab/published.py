"""Published figures Lily is compared with, in one place (data only).

``lily bench --protocol pplx`` reports its run next to :data:`PPLX_PUBLISHED_M5MAX`;
``lily estimate`` is calibrated on the same table and the earlier run's
(:func:`lily.lab.calibration.calibrate_reference`);
both report :data:`LENGTHS` by default.
"""

from __future__ import annotations

#: The ten prompt / context lengths of the headline means (docs/goals.md; pplx-garden's table):
#: 256, 512, ..., 131072.
LENGTHS = tuple(2 ** i for i in range(8, 18))

#: Where pplx-garden published its M5 Max table, and the source its decode step was read from
#: (:func:`lily.lab.calibration.reference_decode_step`).
PPLX_TABLE_SOURCE = "perplexityai/pplx-garden lily/docs/2026-09-02-performance-mlx-0.32.2.md"
PPLX_CODE_SOURCE = "perplexityai/pplx-garden lily/src at f263d07"

#: pplx-garden's published M5 Max table (:data:`PPLX_TABLE_SOURCE`): length -> (their decode,
#: MLX-LM decode, their prefill, MLX-LM prefill) in tokens/s, for comparison with a
#: ``--protocol pplx`` run on an M5 Max.
PPLX_PUBLISHED_M5MAX = {
    256: (194.7, 148.5, 2866.6, 2536.4), 512: (193.8, 149.5, 3859.9, 3309.5),
    1024: (193.3, 148.1, 4734.6, 4471.7), 2048: (190.4, 147.6, 5274.3, 5121.9),
    4096: (182.8, 145.6, 5724.4, 5165.7), 8192: (180.5, 136.8, 5457.6, 5031.8),
    16384: (167.0, 129.6, 4968.5, 4722.5), 32768: (151.1, 118.2, 3927.5, 3963.7),
    65536: (125.4, 98.5, 2752.5, 3051.1), 131072: (92.7, 75.0, 1792.7, 2237.5),
}

#: pplx-garden's earlier M5 Max run of the same engine generation
#: (lily/docs/2026-09-01-performance-mlx-0.31.2.md: mlx 0.31.2, mlx-lm 0.31.3, a different build
#: of their engine), same layout as :data:`PPLX_PUBLISHED_M5MAX`: a second measurement of their
#: step for the calibration (:mod:`lily.lab.calibration`).
PPLX_PUBLISHED_M5MAX_0901 = {
    256: (194.2, 146.9, 2875.7, 1923.7), 512: (193.7, 146.5, 3872.0, 2693.7),
    1024: (193.8, 144.9, 4738.9, 3903.1), 2048: (190.2, 143.6, 5275.8, 4688.0),
    4096: (182.6, 141.2, 5728.8, 4690.1), 8192: (179.9, 133.9, 5456.0, 4518.7),
    16384: (166.3, 124.5, 4903.2, 4104.9), 32768: (150.5, 116.8, 3884.0, 3355.0),
    65536: (126.0, 96.6, 2830.4, 2428.7), 131072: (93.7, 74.5, 1781.7, 1525.9),
}

#: pplx-garden's contract: exactly this many timed decode steps after the first token.
PPLX_DECODE_STEPS = 64
#: Barrier stages of pplx-garden's decode step, as read in :data:`PPLX_CODE_SOURCE`.
PPLX_STAGES_PER_STEP = 425
