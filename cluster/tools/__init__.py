"""Offline tools serving never imports: the load-test harness (bench), the capacity planner,
the fleet simulator (sim) and the namespace test hosts (testbed)."""
