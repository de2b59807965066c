"""The builders make the cases the drills' tests say they make. These checks of our
own fixtures live apart from the learner-facing tests, so a learner never fails a
test because of a fixture: each drill's in its module (`Drill.fixture_checks`),
the shared builder's here."""
import pytest
import torch

from _manifest import DRILLS
from _paged import changed, never_written, poisoned_out, snapshot


@pytest.mark.parametrize("check", [c for d in DRILLS for c in d.fixture_checks],
                         ids=[f"{d.id}-{c.__name__}" for d in DRILLS for c in d.fixture_checks])
def test_drill_fixtures(device, check):
    check(device)


def test_poisoned_out_is_nan_inside_and_noise_around(device):
    out = poisoned_out((3, 4, 5), torch.float16, device, torch.Generator().manual_seed(0))
    assert bool(never_written(out.view).all())
    assert not bool(never_written(out.outside()).any()) and bool(torch.isfinite(out.outside()).all())
    before = snapshot(out.view)
    out.storage[-1] = 0
    assert changed(before) == [0]  # a write past the view shows as a change of its storage
