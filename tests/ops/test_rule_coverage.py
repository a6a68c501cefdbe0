"""Every registered torch function is reached by the suite (runs last: conftest.py moves it).

``conftest.py`` records each registered function that reaches graphgrad's dispatch while the
tests run. A rule nobody calls is a rule nobody checked.
"""

import pytest

from conftest import REACHED
from graphgrad.rules import RULES, qualified_name


def test_every_registered_function_is_reached(request):
    if not request.config.whole_suite:
        pytest.skip("needs the whole suite (it checks what all the other tests reached)")
    missing = sorted(qualified_name(f) for f in RULES if f not in REACHED)
    assert not missing, f"{len(missing)} registered functions no test reaches: {missing}"
