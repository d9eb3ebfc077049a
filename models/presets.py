"""The policy presets' sizes and the Gaussian's constant, without torch (the launcher's options
read them)."""

from __future__ import annotations

import math

#: Hidden sizes of the named presets. ``mlp-small`` is CleanRL's MuJoCo PPO network.
#: ``mlp-large`` is sized so that serving 64 observations costs about as much as stepping
#: 64 HalfCheetah envs on one core: ``bench throughput``'s in-process loop spent 0.92-0.94 of
#: its env time in inference at 1040 wide on the reference 2-core machine (2 runs; 1024 wide:
#: 0.90-0.92, 1056: 0.94-0.97). A speed-up of either side moves it out of that band: re-measure
#: and re-size after one (the widths before, 768, 1024 and 1152, and why each moved:
#: docs/performance-log.md).
POLICY_PRESETS: dict[str, tuple[int, ...]] = {
    "mlp-small": (64, 64),
    "mlp": (256, 256),
    "mlp-large": (1040, 1040, 1040),
}

#: log(2 pi), the Gaussian log-density's constant.
LOG_2PI = math.log(2.0 * math.pi)
