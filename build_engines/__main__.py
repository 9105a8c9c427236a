from build_engines.cli import main

raise SystemExit(main())
