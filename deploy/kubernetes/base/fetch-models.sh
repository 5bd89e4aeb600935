#!/bin/sh
# Puts the models a pod needs under /models (mounted from the ConfigMap specrelay-models-fetch):
#   fetch-models.sh target            the target model            -> /models/target   (cloud workers)
#   fetch-models.sh draft target-tok  the draft, and the target's config + tokenizer files only
#                                     -> /models/draft, /models/target  (edge workers: the target's context)
# TARGET_MODEL / DRAFT_MODEL (models.env): Hugging Face hub ids, or TARGET_MODEL=demo for the demo pair that ships
# inside the package. Files already there are skipped (`hf download` is idempotent); each part done leaves a
# marker /models/.ready-PART, which the shared-models component's pods wait for.
set -eu
cd "${MODELS_DIR:-/models}"  # /models in a pod (another directory to try it outside one)
demo=""
if [ "$TARGET_MODEL" = demo ]; then
  demo="$(python -c 'import os, specrelay.models as m; print(os.path.dirname(m.__file__))')"
fi
for part in "$@"; do
  case "$part" in
    target)
      mkdir -p target
      if [ -n "$demo" ]; then cp -r "$demo/demo-target/." target
      else hf download "$TARGET_MODEL" --local-dir target --exclude '*.pth' --exclude 'original/*'; fi ;;
    target-tok)
      mkdir -p target
      if [ -n "$demo" ]; then cp "$demo"/demo-target/*.json target/
      else hf download "$TARGET_MODEL" --local-dir target --include '*.json' --include 'tokenizer*'; fi ;;
    draft)
      mkdir -p draft
      if [ -n "$demo" ]; then cp -r "$demo/demo-draft/." draft
      else hf download "$DRAFT_MODEL" --local-dir draft --exclude '*.pth' --exclude 'original/*'; fi ;;
    *) echo "fetch-models.sh: unknown part $part (target, target-tok, draft)" >&2; exit 2 ;;
  esac
  touch ".ready-$part"
done
ls -l ./*
