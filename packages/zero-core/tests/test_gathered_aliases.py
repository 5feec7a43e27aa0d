"""A tensor kept from a gathered_parameters block stays valid after it (issue 46's trap 5).

DeepSpeed-Chat's ZeRO-3 export does ``v.data.cpu()`` inside ``GatheredParameters`` and
saves it after the block. On a CPU device ``.cpu()`` returns the same tensor, a view of
the unit's gathered storage: the release used to take that storage away, so reading the
kept tensor read freed memory (a segmentation fault) and saving it wrote garbage. The
check runs in a child process, so that a regression is a failed test, not a crashed run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import io, torch, zero_core
    from zero_comm import run_simulated

    def body(comm):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)]
        model = torch.nn.Sequential(*layers)
        engine = zero_core.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      zero_core.ZeroConfig(stage=3, persistence_threshold=0), comm)
        expected = {k: v.clone() for k, v in engine.full_state_dict().items()}
        kept = {}
        with engine.gathered_parameters():
            for name, p in model.named_parameters():
                kept[name] = p.data.cpu()  # the same tensor on a CPU device
        for step in range(2):  # the units are gathered and released again meanwhile
            engine.backward(engine(torch.ones(2, 32)).sum())
            engine.step()
        for name, value in kept.items():
            assert value.untyped_storage().nbytes() > 0, name
            assert torch.equal(value.clone(), expected[name]), name
            buffer = io.BytesIO()
            torch.save(value, buffer)
            buffer.seek(0)
            assert torch.equal(torch.load(buffer), expected[name]), name
        return "ok"

    print(run_simulated(2, body))
    """
)


def test_a_tensor_kept_from_a_gathered_block_keeps_its_values() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert "['ok', 'ok']" in done.stdout
