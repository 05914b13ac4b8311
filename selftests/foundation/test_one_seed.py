"""Self-tests: one seed per run; ``--tvc-seed`` replays generated prompts exactly.

The contract tier's prompts mix the run seed into their token ids
(:func:`tvc.contract.builders.prompt_tokens`), so the rerun line a red prints
(``--tvc-seed=N``) rebuilds the same token ids on every xdist worker.
"""

from __future__ import annotations

import pytest

from tvc.core import seed as run_seed

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.hw_any

TESTS = """
import os
from pathlib import Path

import pytest
from tvc.core.seed import run_seed

pytestmark = pytest.mark.level1

@pytest.mark.parametrize("i", range(4))
def test_seed(tvc_seed, i):
    out = Path(os.environ["TVC_SELFTEST_SEEDS"]) / str(i)
    out.write_text(f"{tvc_seed} {run_seed()}")
"""


def _seeds(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
           *args: str) -> set[tuple[int, int]]:
    out = pytester.mkdir(f"seeds-{len(args)}")
    monkeypatch.setenv("TVC_SELFTEST_SEEDS", str(out))
    pytester.makepyfile(test_s=TESTS)
    result = pytester.runpytest_subprocess(
        "--tvc-profile=example", f"--tvc-report-dir={pytester.path / out.name}-run",
        "-p", "no:cacheprovider", *args, str(pytester.path / "test_s.py"))
    result.assert_outcomes(passed=4)
    return {(int(a), int(b)) for p in out.iterdir()
            for a, b in [p.read_text().split()]}


def test_the_run_seed_is_the_prompt_seed_on_every_worker(pytester, monkeypatch
                                                         ) -> None:
    pytest.importorskip("xdist")
    assert _seeds(pytester, monkeypatch, "--tvc-seed=4242", "-n", "2") == {
        (4242, 4242)}
    random_run = _seeds(pytester, monkeypatch, "-p", "no:xdist")
    assert len(random_run) == 1 and next(iter(random_run))[0] == next(
        iter(random_run))[1]


def test_the_same_seed_gives_the_same_token_ids() -> None:
    pytest.importorskip("vllm")
    from tvc.contract.builders import prompt_tokens

    old = run_seed.run_seed()
    try:
        run_seed.set_run_seed(12345)
        first = prompt_tokens(64, 3)
        run_seed.set_run_seed(12346)
        other = prompt_tokens(64, 3)
        run_seed.set_run_seed(12345)
        assert prompt_tokens(64, 3) == first != other
    finally:
        run_seed.set_run_seed(old)


HASHES = """
from tvc.contract.builders import make_request
from tvc.core.seed import set_run_seed
set_run_seed(11)
r = make_request(num_tokens=48, block_size=16, seed=7)
print(" ".join(bytes(h).hex() for h in r.block_hashes))
"""


def test_block_hashes_are_the_same_in_every_process() -> None:
    """The same prompt has the same block hashes in two processes.

    A connector that keys its store by block hash then names its entries the
    same in a replay (vLLM 0.26/0.28 draw ``NONE_HASH`` at random; the harness
    uses 0.33's fixed default), and PYTHONHASHSEED still wins when set.
    """
    pytest.importorskip("vllm")
    import os
    import subprocess
    import sys

    def hashes(**env: str) -> list[str]:
        clean = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        out = subprocess.run([sys.executable, "-c", HASHES], check=True,
                             capture_output=True, text=True, env={**clean, **env})
        return out.stdout.splitlines()[-1].split()  # vLLM logs to stdout first

    first, second = hashes(), hashes()
    assert len(first) == 3 and first == second, (first, second)
    assert hashes(PYTHONHASHSEED="5") == hashes(PYTHONHASHSEED="5") != first
