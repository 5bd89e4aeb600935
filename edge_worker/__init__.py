"""The edge worker: holds the draft model, drafts for its sessions, applies the cloud's verdicts, serves clients."""
