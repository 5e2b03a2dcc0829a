"""Federated PPO on LunarLander-v3 across planets (the PPO study): the task, its clients'
environments, local PPO, the clients' training logs and the study plots."""

from tasks.lunar_lander.clients import ClientEnv, client_from_node_config, client_table
from tasks.lunar_lander.task import LunarLanderTask

__all__ = ["ClientEnv", "LunarLanderTask", "client_from_node_config", "client_table"]
