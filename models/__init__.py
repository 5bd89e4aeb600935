"""The demo model pair (package data): demo-target, demo-draft, demo-draft-xv. See README.md here."""
