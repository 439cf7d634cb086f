#!/usr/bin/env python
"""The training script a researcher starts from, on one device. scripts/plain_ddp.py is this script made
distributed: the lines that differ between the two are the lesson (notebook 03 shows the diff).

    python scripts/plain_single.py --steps 20
"""

import argparse
import json

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

torch.manual_seed(0)
model = torch.nn.Linear(8, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
target = torch.arange(8, dtype=torch.float32, device=device)  # learn y = x . target
g = torch.Generator().manual_seed(0)
losses = []
for _ in range(args.steps):
    x = torch.randn(32, 8, generator=g).to(device)
    loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())

print("PLAIN " + json.dumps({"world_size": 1, "first_loss": losses[0], "last_loss": losses[-1]}), flush=True)
