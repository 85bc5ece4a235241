"""Files an installation copies: the systemd units (boards, balancer, HTTP front) and their example configs."""
