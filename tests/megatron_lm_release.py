"""The Megatron-LM release the Megatron-LM tests run against, chosen at test time.

``METP_MEGATRON_LM_RELEASE=<tag>`` (``core_v0.16.1`` or ``core_v0.19.0``) names it; unset, it is
the release of the installed megatron-core wheel (0.16.x -> core_v0.16.1, 0.19.x -> core_v0.19.0).
The ``megatron_lm_checkout`` fixture (``tests/conftest.py``) unpacks that release's archive,
``../shared/megatron-lm/<tag>.git.tar``, unless ``MEGATRON_LM_DIR`` names a checkout.
"""

import os

from megatron_metp.megatron_lm import releases

ENV = "METP_MEGATRON_LM_RELEASE"


def selected() -> releases.Release:
    tag = os.environ.get(ENV, "").strip()
    return releases.by_tag(tag) if tag else releases.for_megatron_core()


#: the release of this test session
RELEASE = selected()
#: the commit of its tag
TAG_COMMIT = RELEASE.commit
