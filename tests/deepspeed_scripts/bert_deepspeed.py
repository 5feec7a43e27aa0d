"""A small BERT-style masked language model fine-tuned the way DeepSpeed-Chat's step-1
script and HelloDeepSpeed's BERT are written: the script builds its own distributed
sampler from ``--local_rank``, its AdamW over two parameter groups and a warm-up schedule
on that optimizer before ``deepspeed.initialize``, and passes both in. At the end it saves a
checkpoint (``save_checkpoint``) into the folder that holds its ``hparams.json``, and
exports the weights, gathering each ZeRO-3 parameter (``hasattr(p, "ds_id")``) inside
``deepspeed.zero.GatheredParameters``.

    deepspeed --num_gpus 2 bert_deepspeed.py --zero_stage 3 --dtype bf16 --output_dir out

Rank 0 prints one line per step, ``step N loss X lr Y`` (the learning rate the user's
schedule set); the exported weights go to ``--output_dir``/pytorch_model.bin, beside
hparams.json and the checkpoint. The only lines that name DeepSpeed are the two imports
(tests/deepspeed_scripts/port.py rewrites them).
"""

import argparse
import json
import math
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

IGNORE_INDEX = -100


def parse_args():
    parser = argparse.ArgumentParser(description="Fine-tune a small masked language model")
    parser.add_argument("--local_rank", type=int, default=-1, help="local_rank for distributed")
    parser.add_argument("--zero_stage", type=int, default=0, help="ZeRO optimization stage")
    parser.add_argument("--dtype", type=str, default="fp32", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=32, help="synthetic sequences")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output_dir", type=str, default=None, help="export the weights here")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_train_ds_config(stage, dtype):
    """The config DeepSpeed-Chat writes in code rather than in a JSON file."""
    return {
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 64,
            "stage3_max_live_parameters": 30000000,
            "stage3_prefetch_bucket_size": 30000000,
            "memory_efficient_linear": False,
        },
        "fp16": {"enabled": dtype == "fp16", "loss_scale_window": 100},
        "bf16": {"enabled": dtype == "bf16"},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }


class Config:
    vocab = 96
    width = 32
    heads = 4
    layers = 2
    context = 16


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.heads
        self.query = nn.Linear(config.width, config.width)
        self.key = nn.Linear(config.width, config.width)
        self.value = nn.Linear(config.width, config.width)
        self.output = nn.Linear(config.width, config.width)

    def forward(self, x):
        b, t, c = x.shape
        head = c // self.heads

        def split(y):
            return y.view(b, t, self.heads, head).transpose(1, 2)  # (B, nh, T, hs)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(head), dim=-1)  # (B, nh, T, T)
        y = (weights @ v).transpose(1, 2).reshape(b, t, c)  # (B, T, C)
        return self.output(y)


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.width)
        self.intermediate = nn.Linear(config.width, 4 * config.width)
        self.out = nn.Linear(4 * config.width, config.width)
        self.output_norm = nn.LayerNorm(config.width)

    def forward(self, x):
        x = self.attention_norm(x + self.attention(x))  # post-norm, as BERT
        return self.output_norm(x + self.out(F.gelu(self.intermediate(x))))


class MaskedLM(nn.Module):
    """Embeddings, encoder layers and a head whose weight is the word embedding's (tied,
    as Hugging Face ties them: the one Parameter held by two modules)."""

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab, config.width)
        self.position_embeddings = nn.Embedding(config.context, config.width)
        self.embedding_norm = nn.LayerNorm(config.width)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.layers))
        self.decoder = nn.Linear(config.width, config.vocab, bias=False)
        self.decoder.weight = self.word_embeddings.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        """BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def forward(self, input_ids, labels):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embedding_norm(
            self.word_embeddings(input_ids) + self.position_embeddings(positions)
        )
        for layer in self.layers:
            x = layer(x)
        logits = self.decoder(x)  # (B, T, vocab)
        return F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=IGNORE_INDEX
        )


def masked_dataset(samples, config, seed):
    """Random token sequences with 15% of positions masked (token 0), from a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, config.vocab, (samples, config.context), generator=generator)
    masked = torch.rand(samples, config.context, generator=generator) < 0.15
    masked[:, 0] = True  # every sequence has a target
    inputs = tokens.masked_fill(masked, 0)
    labels = tokens.masked_fill(~masked, IGNORE_INDEX)
    return TensorDataset(inputs, labels)


def get_optimizer_grouped_parameters(model, weight_decay, no_decay_name_list=("bias", "norm")):
    return [
        {
            "params": [
                p
                for n, p in model.named_parameters()
                if not any(nd in n for nd in no_decay_name_list) and p.requires_grad
            ],
            "weight_decay": weight_decay,
        },
        {
            "params": [
                p
                for n, p in model.named_parameters()
                if any(nd in n for nd in no_decay_name_list) and p.requires_grad
            ],
            "weight_decay": 0.0,
        },
    ]


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step + 1) / float(max(1, num_warmup_steps))
        left = num_training_steps - current_step
        return max(0.0, float(left) / float(max(1, num_training_steps - num_warmup_steps)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    """DeepSpeed-Chat's export: each parameter gathered whole inside GatheredParameters
    where it is partitioned (ZeRO-3), copied, then saved by rank 0."""
    zero_stage_3 = zero_stage == 3
    os.makedirs(save_dir, exist_ok=True)
    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():
            if hasattr(v, "ds_id"):
                with deepspeed.zero.GatheredParameters([v], enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict


def main():
    args = parse_args()
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()

    ds_config = get_train_ds_config(args.zero_stage, args.dtype)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (
        args.per_device_train_batch_size
        * torch.distributed.get_world_size()
        * args.gradient_accumulation_steps
    )
    torch.manual_seed(args.seed)
    torch.distributed.barrier()

    if args.output_dir is not None and args.global_rank == 0:
        # HelloDeepSpeed keeps its hyper-parameters beside the checkpoints it saves there
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "hparams.json"), "w") as f:
            json.dump({k: v for k, v in vars(args).items() if k != "deepspeed_config"}, f)

    config = Config()
    model = MaskedLM(config)
    train_dataset = masked_dataset(args.samples, config, args.seed)
    if args.local_rank == -1:
        train_sampler = RandomSampler(train_dataset)
    else:
        train_sampler = DistributedSampler(train_dataset)
    train_dataloader = DataLoader(
        train_dataset, sampler=train_sampler, batch_size=args.per_device_train_batch_size
    )

    optimizer_grouped_parameters = get_optimizer_grouped_parameters(model, args.weight_decay)
    optimizer = torch.optim.AdamW(
        optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95)
    )
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.num_train_epochs * num_update_steps_per_epoch,
    )
    model, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        args=args,
        config=ds_config,
        lr_scheduler=lr_scheduler,
        dist_init_required=True,
    )

    step = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        for batch in train_dataloader:
            input_ids, labels = (t.to(device) for t in batch)
            loss = model(input_ids, labels)
            model.backward(loss)
            model.step()
            if args.global_rank == 0:
                print(
                    f"step {step} loss {loss.item()!r} lr {lr_scheduler.get_last_lr()[0]!r}",
                    flush=True,
                )
            step += 1
        if args.global_rank == 0:
            print(f"epoch {epoch} done", flush=True)

    if args.output_dir is not None:
        model.save_checkpoint(args.output_dir, client_state={"step": step})
        save_zero_three_model(model, args.global_rank, args.output_dir, zero_stage=args.zero_stage)


if __name__ == "__main__":
    main()
