#!/usr/bin/env python
"""Training on one device: the script a researcher starts from. plain_ddp.py is this script made distributed
(notebook 03 shows the diff), plain_resumable.py that one made to survive a kill and a time limit (notebook 05).

    python scripts/plain_single.py --epochs 3
"""

import argparse

import torch
from torch.utils.data import DataLoader

from plain_parts import build_model, evaluate, get_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--n-train", type=int, default=4096, help="images of the offline data set")
parser.add_argument("--n-val", type=int, default=1024, help="held-out images of the offline data set")
parser.add_argument("--data", default=None, help="a folder with torchvision's MNIST, instead of the offline data")
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# mixed precision where the GPU has it: bf16 from compute capability 8 (A100, H100), fp16 with loss scaling before
amp_dtype = None
if device.type == "cuda":
    amp_dtype = torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

torch.manual_seed(0)
model = build_model().to(device)
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
dataset = get_dataset(args.n_train, args.data)
loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                    num_workers=args.workers, pin_memory=device.type == "cuda")
val_loader = DataLoader(get_dataset(args.n_val, args.data, train=False), batch_size=256)

for epoch in range(args.epochs):
    total, steps = torch.zeros((), device=device), 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        total += loss.detach()
        steps += 1
    loss_sum, correct, seen = evaluate(model, val_loader, device).tolist()
    print(f"epoch {epoch}: loss {total.item() / steps:.4f} ({steps} steps of {args.batch_size} images on {device}); "
          f"held-out loss {loss_sum / seen:.4f}, accuracy {correct / seen:.1%}", flush=True)
