//! The router registry: one [`Router`] per router type, built at start-up.
//! The gateway is the only code that names every router.

use std::collections::HashMap;
use std::sync::Arc;

use autopush_common::RouterType;
use autopush_common::router::Router;

#[derive(Default, Clone)]
pub struct RouterRegistry {
    routers: HashMap<RouterType, Arc<dyn Router>>,
}

impl RouterRegistry {
    pub fn with(mut self, router_type: RouterType, router: Arc<dyn Router>) -> Self {
        self.routers.insert(router_type, router);
        self
    }

    /// The router for `router_type`, if this service is configured for it.
    pub fn get(&self, router_type: RouterType) -> Option<&Arc<dyn Router>> {
        self.routers.get(&router_type)
    }
}
