"""A finished shard into an object store, exactly once (the protocol: docs/object-store.md).

S3 has no rename, but a PUT (or a completed multipart upload) is atomic: the object appears whole
or not at all. So a shard's Parquet file is written to a local spool file first, then

    1. the claim is refreshed (If-Match on its ETag): a rank whose lease was taken over stops here;
    2. the done marker `__batchvlm__/<stem>.stats.json` is written with a conditional PUT on the
       marker as it was when the shard was claimed (If-None-Match: * where there was none, else
       If-Match on its ETag, both kept in the claim): if any other rank committed the shard since,
       this fails and this rank writes nothing more;
    3. the Parquet object is uploaded to its final key (`<prefix>/<stem>.parquet`, or
       `__batchvlm__/partial/` for a shard cut short by --limit);
    4. a done shard's partial object is deleted.

Until 3 completes, the marker names an object that is not there (or not of its size): the shard
is not done, and the next run labels it again. The spool file lives in the system temp folder and
is removed whatever happens.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .layout import Layout
from .storepath import StorePath


@dataclass(frozen=True)
class Held:
    """A claim this rank holds (claims_store.py): its ETag, and the done marker's as it was when
    the shard was claimed (None: there was none), on which the commit's marker PUT is conditional."""
    claim: str
    marker: str | None


class CommitLost(RuntimeError):
    """Another rank holds or committed this shard: this rank writes nothing of it."""


def commit_to_store(layout: Layout, stem: str, table: pa.Table, compression: str, stats: dict[str, Any],
                    confirm: Callable[[str], Held | None] | None = None) -> None:
    """`confirm`: the claims' (StoreClaims.confirm); None where no claim guards the shard."""
    done = bool(stats.get("complete"))
    final: StorePath = layout.parquet(stem) if done else layout.partial(stem)
    marker: StorePath = layout.stats(stem)
    store = final.store
    fd, spool = tempfile.mkstemp(prefix=f"batchvlm-{stem}-", suffix=".parquet")
    os.close(fd)
    try:
        pq.write_table(table, spool, compression=None if compression == "none" else compression)
        size = os.path.getsize(spool)
        if confirm is None:  # no claim (a single writer): the marker as it is now
            prior = (info.etag if (info := store.head(marker.key)) else None)
        elif (held := confirm(stem)) is None:  # 1
            raise CommitLost(f"{stem}: its claim was taken over (this rank was too slow to refresh it); not written")
        else:
            prior = held.marker
        data = json.dumps(stats | {"output": {"size": size}}, indent=1).encode()
        if store.put(marker.key, data, if_none_match=prior is None, if_match=prior) is None:  # 2
            raise CommitLost(f"{stem}: another rank committed it since this rank claimed it; not written twice")
        store.upload(final.key, spool)  # 3
    finally:
        os.unlink(spool)
    if done:
        layout.partial(stem).unlink(missing_ok=True)  # 4
