"""An edge's way to the cloud: the probe before anything loads, one link per broker, and where a session's
replies go and how its failures are retried."""
