"""What a board daemon tells about itself: Prometheus metrics, the Perfetto trace, and the observers the loop
feeds them through."""
