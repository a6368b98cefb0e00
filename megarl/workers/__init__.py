"""Megatron-side roles: ActorWorker, CriticWorker, ReferenceWorker (megarl/workers/{actor,critic,reference}.py)."""
