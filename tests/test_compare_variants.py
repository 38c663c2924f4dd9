"""Every `gspo compare` variant is a valid config of a registered loss."""

from gspo.compare import VARIANTS
from gspo.config import Config
from gspo.losses import LOSSES


def test_every_loss_has_a_compare_variant_and_each_validates():
    assert {v["algo"] for v in VARIANTS.values()} == set(LOSSES)
    for name, kw in VARIANTS.items():
        assert Config(**kw).validate().algo == kw["algo"], name
