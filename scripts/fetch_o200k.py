"""Put ``o200k_base.tiktoken``, the vocabulary openai-harmony needs for gpt-oss's chat format, where
Sluice looks for it (``$TIKTOKEN_ENCODINGS_BASE``, else ~/.cache/sluice/tiktoken), without
openaipublic.blob.core.windows.net: the npm registry's ``tiktoken`` package ships the same ranks
(``encoders/o200k_base.json``), which rebuild the file byte for byte; its sha256 is checked
against the one openai-harmony checks.

    python scripts/fetch_o200k.py          # nothing to do when the file is there"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from frontend.http.harmony.encoding import VOCAB_FILE, VOCAB_SHA256, encodings_dir  # noqa: E402

TARBALL = "https://registry.npmjs.org/tiktoken/-/tiktoken-1.0.22.tgz"
TARBALL_SHA1 = "a6c674839228bb88f32dfe646dff47193762f7d3"  # the registry's dist.shasum
MEMBER = "package/encoders/o200k_base.json"


def tiktoken_file(bpe_ranks: str) -> bytes:
    """js-tiktoken's compact ranks (a line per run: a key, the first rank, then base64 tokens of
    consecutive ranks) as the .tiktoken file: ``base64 rank`` a line, by rank."""
    ranks: dict[int, str] = {}
    for line in bpe_ranks.splitlines():
        fields = line.split(" ")
        if len(fields) > 2:
            first = int(fields[1])
            ranks.update((first + i, token) for i, token in enumerate(fields[2:]))
    return "".join(f"{ranks[r]} {r}\n" for r in sorted(ranks)).encode()


def download() -> bytes:
    with urllib.request.urlopen(TARBALL, timeout=120) as response:
        data = response.read()
    if hashlib.sha1(data).hexdigest() != TARBALL_SHA1:
        raise SystemExit(f"{TARBALL}: unexpected sha1")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = tar.extractfile(MEMBER)
        assert member is not None
        return tiktoken_file(json.load(member)["bpe_ranks"])


def main() -> int:
    target = encodings_dir() / VOCAB_FILE
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == VOCAB_SHA256:
        return 0
    data = download()
    if hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        raise SystemExit(f"the rebuilt {VOCAB_FILE} does not match openai-harmony's sha256")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(target)
    print(f"wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
