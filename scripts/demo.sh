#!/usr/bin/env bash
# `make demo`: the whole chain on small synthetic data. Grows as the runtime lands.
set -euo pipefail
PY=${1:-python3}
WORK=${2:-demo_work}
mkdir -p "$WORK"
"$PY" main.py --help >/dev/null
"$PY" - <<'PYEOF'
import torch
from model.unet3d import Unet3D
from model.losses import DiceCELoss, DiceScore
torch.manual_seed(0)
model = Unet3D(filters=(4, 8, 16, 32, 40))
x = torch.randn(1, 1, 64, 64, 64); y = torch.randint(0, 3, (1, 1, 64, 64, 64))
loss = DiceCELoss()(model(x), y); loss.backward()
print(f"demo: one training step of a small UNet3D, loss {loss.item():.4f}")
PYEOF
