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
