"""Writing the viewer: a static folder opened from `file://` (no server, nothing fetched from a network).

Layout of `OUT/`:

* `index.html`, `viewer.css`, `viewer.js`, `problem.js`, `cachemap.js`: copied from the package
  (`protocol/viewer/static/`); every script and style the page uses is one of these;
* `data/index.js`: `RV.index({...})`, the index (arms, comparisons, one row per problem and sample);
* `data/r/<i>.js`: `RV.record(i, {...})`, one (problem, sample) with every arm's record, loaded by
  adding a `<script>` tag when the page opens it (`fetch` of a local file is refused under file://);
* `figures/*.png`: the report's figures, when given;
* `viewer.json`: what wrote the folder. A folder holding it is replaced as a whole by the next
  `retention view`; any other non-empty folder is refused, never overwritten.

The site is written into a temporary sibling folder and renamed into place, so `OUT` holds one
complete site or the previous one, never a mix.
"""

from __future__ import annotations

import html
import os
import shutil
import tempfile
import uuid
from importlib import resources
from pathlib import Path

from protocol.errors import ProtocolError
from protocol.io import canonical_json, dumps, load_json_object
from protocol.viewer.extract import SiteData

MARKER = "viewer.json"
STATIC = ("viewer.css", "viewer.js", "problem.js", "cachemap.js")
FORMAT = 1


def _js_call(fn: str, *args) -> str:
    """`fn(arg, ...);` with each argument as strict, compact JSON (U+2028/9 escaped for older JS parsers)."""
    body = ", ".join(canonical_json(a) for a in args).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return f"{fn}({body});\n"


def static_text(name: str) -> str:
    return (resources.files("protocol.viewer") / "static" / name).read_text(encoding="utf-8")


def check_target(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ProtocolError(f"viewer folder {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ProtocolError(f"viewer folder {out} is not empty and holds no viewer ({MARKER}); "
                            "give an empty or new folder")
    if (out / MARKER).is_file():
        load_json_object(out / MARKER, "viewer marker")  # a damaged marker is refused, not trusted


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write(path: Path, text: str) -> int:
    data = text.encode("utf-8")
    path.write_bytes(data)
    return len(data)


def write_site(data: SiteData, out, *, figures: dict | None = None) -> dict:
    """Write the site of `data` into folder `out`; returns {"index": index.html path, "files": count,
    "record_bytes": bytes of the per-problem files, "records": their count}."""
    out = Path(out)
    check_target(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.writing-", dir=out.parent))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would hide the site from other users
    except OSError as exc:
        raise ProtocolError(f"cannot write viewer folder {out}: {exc.strerror or exc}") from None
    try:
        (tmp / "data" / "r").mkdir(parents=True)
        page = static_text("index.html").replace("{{title}}", html.escape(str(data.index["title"])))
        files = [_write(tmp / "index.html", page)]
        files += [_write(tmp / name, static_text(name)) for name in STATIC]
        files.append(_write(tmp / "data" / "index.js", _js_call("RV.index", data.index)))
        record_bytes = 0
        for i, payload in data.payloads():
            size = _write(tmp / "data" / "r" / f"{i}.js", _js_call("RV.record", i, payload))
            record_bytes += size
            files.append(size)
        if figures:
            (tmp / "figures").mkdir()
            for name, png in figures.items():
                (tmp / "figures" / Path(name).name).write_bytes(png)
                files.append(len(png))
        _write(tmp / MARKER, dumps({"format": FORMAT, "records": len(data.problems),
                                    "arms": len(data.arms)}, indent=1) + "\n")
        _publish(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ProtocolError(f"cannot write viewer folder {out}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"index": out / "index.html", "files": len(files) + 1, "records": len(data.problems),
            "record_bytes": record_bytes}


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` onto `out`; an earlier site (or an empty folder) there is removed."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
