"""`python -m dynamo_pd.decode`: start one decode worker (see dynamo_pd.worker)."""

from dynamo_pd.engines.base import EngineRole
from dynamo_pd.worker import main as _worker_main


def main() -> None:
    _worker_main(EngineRole.DECODE)


if __name__ == "__main__":
    main()
