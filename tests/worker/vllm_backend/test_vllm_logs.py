"""vLLM's own log lines in the job's shape (vllm_backend/logs.py): the configuration an inference
pod hands vLLM, applied with Python's logging as vLLM applies it, makes a vLLM logger's record a
line that starts with its UTC time and names vLLM's process; a pod whose environment configures
vLLM's logging keeps its own."""

import json
import logging
import logging.config
import re
from pathlib import Path

from weightsync.vllm_backend.logs import CONFIG_PATH, logging_config, logging_env

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \[vllm EngineCore pid=\d+\] INFO \[test_vllm_logs\.py:\d+\] "
                  r"init engine took 0\.20 s$")


def test_a_vllm_record_is_a_line_with_its_utc_time_and_vllms_process(capsys):
    logging.config.dictConfig(logging_config("INFO"))
    logger = logging.getLogger("vllm.v1.engine.core")
    try:
        logger.info("init engine took %.2f s", 0.2, extra={"vllm_process_name": "EngineCore"})
        logger.debug("not at INFO")
    finally:
        logging.getLogger("vllm").handlers.clear()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and LINE.match(out[0]), out


def test_the_pod_writes_the_configuration_unless_its_environment_has_its_own(tmp_path):
    env = logging_env({"VLLM_LOGGING_LEVEL": "debug"})
    config = json.loads(Path(env[CONFIG_PATH]).read_text())
    Path(env[CONFIG_PATH]).unlink()
    assert config["loggers"]["vllm"]["level"] == "DEBUG"
    assert logging_env({CONFIG_PATH: str(tmp_path / "mine.json")}) == {}
    assert logging_env({"VLLM_CONFIGURE_LOGGING": "0"}) == {}
