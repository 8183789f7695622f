"""Tuning campaigns as stored, running things (issue 25): the request a user submits
(``campaign_request``), its intake (``intake``: checked as the experiment its first round
would submit) and the service (``service``) that rebuilds a campaign's decisions from its
recorded runs (:mod:`orchestrator.campaigns`, the pure core), queues the next runs as
one-variable experiments, and writes the result. The dispatcher's ``campaigns`` loop
advances every running campaign, so a restarted service just goes on.
"""
