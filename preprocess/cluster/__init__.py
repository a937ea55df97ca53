"""Ray: joining or starting a cluster, running the tasks, watching them, stopping cleanly."""
