"""Replicas of the engine behind Ray Serve: an OpenAI ingress, prefix-aware routing, and gray
release of engine flags with SLO rollback.

    HTTP -> Serve proxy -> OpenAIIngress (one per cluster by default)
              OpenAIServing (deepbatch/api) on a RoutedEngineClient:
                tokenize, pick the arm (stable | canary, by tenant hash and the rollout's percent),
                route through the arm's DeploymentHandle (PrefixAwareRouter picks the replica),
                retry on stable what failed before streaming, record per-arm samples
              RolloutController: sliding-window SLO watch, promotion steps, rollback
           -> EngineReplica (one engine core each; deployments "stable" and "canary")

Nothing outside this package imports it, and nothing in it is imported by the engine or the
single-process server: ``ray`` is an optional extra. ``rollout_spec``, ``rollout`` and
``prefix_index`` do not import ray either, so their logic is tested without it.
"""
