"""Training of the mini family on procedurally generated talking heads. See trainer.train and MODEL_CARD.md."""

from avatar_cli.train.plan import PLANS, TrainPlan, plan_for
from avatar_cli.train.trainer import train

__all__ = ["train", "TrainPlan", "PLANS", "plan_for"]
