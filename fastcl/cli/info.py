"""``fastcl info``: the same report as ``python -m fastcl.info``."""


def add_parser(sub) -> None:
    sub.add_parser("info", help="versions, devices and available backends")


def run(args) -> int:
    from fastcl.info import main

    main()
    return 0
