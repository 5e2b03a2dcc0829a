"""Secure aggregation: SecAgg+ on the Message API, and DP-FedAvg over a secure sum."""
