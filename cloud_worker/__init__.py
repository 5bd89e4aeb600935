"""The cloud worker: holds the target model and its KV store, verifies the drafts of many sessions per forward."""
