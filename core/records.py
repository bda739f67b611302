"""The typed shape of every artifact a run directory holds, validated when it is read.

Each model names the fields the stages and the report read; everything else an artifact
carries (per-trial details, diagnostics) stays readable as extra fields, so adding a field to
an artifact never breaks reading an older one, while a file that lacks what its readers need,
or holds the wrong type there, is refused with one line naming the file and the first field
that is wrong (`core.artifacts.load`). A field added after runs were written has a default:
old run folders read as they did.

The records live beside their artifacts' stages (`core.run_records`: profile.json to
projection.json and options.json; `core.integration_records`: integration.json;
`core.e2e_records`: e2e.json); readers import them from here.
"""

from __future__ import annotations

from core.e2e_records import *  # noqa: F403
from core.e2e_records import E2E
from core.integration_records import *  # noqa: F403
from core.integration_records import Integration
from core.record import Record
from core.run_records import *  # noqa: F403
from core.run_records import (
    Profile,
    Projection,
    Ranking,
    RunOptions,
    SearchLog,
    VerificationRecord,
    VerificationSummary,
)

# the artifact kinds `read_json` and `load` are asked for, and the model each is checked against
BY_KIND: dict[str, type[Record]] = {
    "profile": Profile,
    "ranking": Ranking,
    "search log": SearchLog,
    "verification summary": VerificationSummary,
    "verification record": VerificationRecord,
    "projection": Projection,
    "integration": Integration,
    "run options": RunOptions,
    "e2e": E2E,
}
