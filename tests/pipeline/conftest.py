import pytest

from tests.pipeline.fake_family import registered


@pytest.fixture
def fake_families():
    """The fake families of `tests.pipeline.fake_family`, registered for this test only."""
    with registered() as fams:
        yield fams
