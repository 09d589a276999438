"""`dtp simulate`: predict a plan's training iteration at scale from FLOPs, the analytic communication
schedule and a hardware profile (no process group, meta device only)."""
