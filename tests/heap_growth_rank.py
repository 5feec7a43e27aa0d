"""One rank of tests/test_heap_growth.py: a stage-3 GPT with every block checkpointed,
trained on one sequence a step; prints (on rank 0) glibc's free heap bytes after each step
as JSON. Run by zero-launch with glibc's mmap threshold fixed at 1 MiB, so the blocks'
512 KiB activations (1 x 128 x 1024 float32) come from the heap. The engine runs on a
communicator split from the world, as tools/peers/bench.py's variants do: on the world
group itself the recorder grew this heap's free bytes by 10 MiB in 6 steps (6 without it),
too little to tell apart."""

import json
import sys

import torch

import zero_comm
import zero_core
from zero_core.memory.host_heap import heap_bytes
from zero_models.checkpoint_plan import checkpoint_gpt_blocks
from zero_models.gpt import GPT, GPTConfig

torch.set_num_threads(1)
steps = int(sys.argv[1])
comm = zero_comm.init("gloo").split(color=0)
config = GPTConfig(vocab_size=256, context=128, layers=4, heads=16, width=1024)
model = GPT(config, seed=0)
checkpoint_gpt_blocks(model, "full", None, contiguous=False)
engine = zero_core.initialize(
    model,
    lambda params: torch.optim.AdamW(params, lr=1e-4),
    # Small gradient buckets: ~200 reduce-scatters a step, not ~13, so the control's
    # recorder holds many more entries and its growth stands clear of the default's
    # (see test_heap_growth.py's docstring).
    zero_core.ZeroConfig(stage=3, release_host_heap=False, bucket_numel=2**18),
    comm,
)
tokens = torch.Generator().manual_seed(comm.rank)
free_mib = []
for _ in range(steps):
    x = torch.randint(0, config.vocab_size, (1, config.context + 1), generator=tokens)
    logits = engine(x[:, :-1])
    targets = x[:, 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, config.vocab_size), targets)
    engine.backward(loss)
    assert engine.step()
    heap = heap_bytes()
    assert heap is not None
    free_mib.append(heap[1] / 2**20)
if comm.rank == 0:
    print("FREE-MIB " + json.dumps(free_mib), flush=True)
engine.close()
comm.close()
