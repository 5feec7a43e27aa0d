"""A small CNN trained on synthetic CIFAR-10-shaped data, written for DeepSpeed the way its
CIFAR-10 tutorial is: launched by ``deepspeed``, configured by ``--deepspeed_config
ds_config.json``, the data handed to ``deepspeed.initialize`` to be distributed.

    deepspeed --num_gpus 2 cifar10_deepspeed.py --deepspeed --deepspeed_config ds.json

The stage and the dtype come from the JSON ("zero_optimization.stage", "bf16"/"fp16").
Rank 0 prints one line per step, ``step N loss X lr Y`` (as Python writes floats, so they
read back exactly; Y is the engine's learning rate after the step), and the checkpoint is
saved under ``--save_dir`` at the end.

The only lines that name DeepSpeed are the two imports: tests/deepspeed_scripts/port.py
rewrites them to zero_core.deepspeed and checks that nothing else changed.
"""

import argparse

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument(
        "--local_rank", type=int, default=-1, help="local rank passed from distributed launcher"
    )
    parser.add_argument("-e", "--epochs", default=1, type=int, help="passes over the data")
    parser.add_argument("--samples", default=64, type=int, help="synthetic training images")
    parser.add_argument("--seed", default=1234, type=int, help="data and model seed")
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def synthetic_cifar(samples, seed):
    """CIFAR-10's shapes (3x32x32 images, 10 classes) from a fixed seed: every rank, and
    every framework, sees the same images."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))  # (B, 6, 14, 14)
        x = self.pool(F.relu(self.conv2(x)))  # (B, 16, 5, 5)
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def main(args):
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    trainset = synthetic_cifar(args.samples, args.seed)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, _optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank

    # the inputs follow the model's dtype, as the tutorial does
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    step = 0
    for _epoch in range(args.epochs):
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            if local_rank == 0:
                lr = model_engine.get_lr()[0]
                print(f"step {step} loss {loss.item()!r} lr {lr!r}", flush=True)
            step += 1

    if args.save_dir is not None:
        model_engine.save_checkpoint(args.save_dir, client_state={"step": step})
    if local_rank == 0:
        print(f"finished {step} steps", flush=True)


if __name__ == "__main__":
    main(add_argument())
