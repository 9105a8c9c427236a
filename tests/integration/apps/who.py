"""A Serve app that says which instance answered: the smallest ingress that can tell
two Serve instances on one machine apart."""

from __future__ import annotations

import os
import time

from fastapi import FastAPI
from ray import serve

api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Who:
    def __init__(self, name: str, start_s: float):
        time.sleep(start_s)  # a slow start, as Triton's: the window a fallback would serve
        self.name = name

    @api.get("/who")
    def who(self) -> dict:
        return {"name": self.name, "pid": os.getpid()}


def build(args: dict):
    return Who.bind(args["name"], float(args.get("start_s", 0)))
