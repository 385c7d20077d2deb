"""The launcher's public names in one place (what the tests, the benches and older code import):

    service_process  ServiceProcess, ServiceError, die_with_parent, describe_exit
    redis_server     private_redis, redis_ping
    wiring           StackConfig, Ports, service_argvs, service_env, tls_env, client_host
    stack            start_stack, Stack, resolve_redis, check_port_free

Nothing is defined here; see each module for its threads and invariants.
"""

from __future__ import annotations

from pagedserve.common.settings import LOOPBACK
from pagedserve.launcher.redis_server import private_redis, redis_ping
from pagedserve.launcher.service_process import (PARENT_PID_ENV, ServiceError, ServiceProcess, describe_exit,
                                                 die_with_parent)
from pagedserve.launcher.stack import Stack, check_port_free, resolve_redis, start_stack
from pagedserve.launcher.wiring import (GATEWAY_FLAGS, SCHEDULER_FLAGS, TOKENIZER_FLAGS, WIRED, WORKER_FLAGS, Ports,
                                        StackConfig, client_host, first_api_key, service_argvs, service_env, tls_env)

__all__ = ["GATEWAY_FLAGS", "LOOPBACK", "PARENT_PID_ENV", "SCHEDULER_FLAGS", "TOKENIZER_FLAGS", "WIRED", "WORKER_FLAGS",
           "Ports", "ServiceError", "ServiceProcess", "Stack", "StackConfig", "check_port_free", "client_host",
           "describe_exit", "die_with_parent", "first_api_key", "private_redis", "redis_ping", "resolve_redis",
           "service_argvs", "service_env", "start_stack", "tls_env"]
