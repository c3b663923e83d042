"""Two outbox sources of one config on one table: every row is claimed by whichever reader
comes first and submitted as that source's zone, so the rows of one application are split
at random between two zones. Run, 20 rows of zone acme read by a second source of zone
globex too: 12 ended `failed` (`550 5.7.1 Sender <billing@acme.example> is not a mapped
alias of zone globex`), 8 were sent. The config is refused instead, naming both sources."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from smtpguard.config import ConfigError, loads
from tests.support.outbox import outbox_config


@pytest.mark.parametrize("zone", ["globex", "acme"])
def test_a_second_source_on_the_same_table_is_refused_naming_the_first(zone: str, tmp: Path) -> None:
    cfg = outbox_config(tmp, 2525, "postgresql://app@db/shop")
    user = next(u["username"] for u in cfg["zones"][zone]["users"])
    cfg["outbox"]["shop2"] = {**cfg["outbox"]["shop"], "zone": zone, "user": user, "poll": "5s"}
    with pytest.raises(ConfigError) as e:
        loads(yaml.safe_dump(cfg, sort_keys=False))
    text = str(e.value)
    assert "outbox.shop2.table (line" in text and "shop" in text and "smtpguard_outbox" in text, text


def test_sources_on_other_tables_or_databases_are_accepted(tmp: Path) -> None:
    cfg = outbox_config(tmp, 2525, "postgresql://app@db/shop")
    cfg["outbox"]["mails"] = {**cfg["outbox"]["shop"], "table": "mails"}
    cfg["outbox"]["blog"] = {**cfg["outbox"]["shop"], "url": "postgresql://app@db/blog"}
    assert sorted(loads(yaml.safe_dump(cfg, sort_keys=False)).outbox) == ["blog", "mails", "shop"]
